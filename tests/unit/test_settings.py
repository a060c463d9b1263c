"""Broker settings: precedence of file < environment < flags, and every error path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceq.broker.config import BrokerConfig
from onceq.broker.settings import BY_KEY, SETTINGS, ConfigError, load, parse_text, read_file
from onceq.storage.config import StoreConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "onceq.toml"
    p.write_text(text)
    return str(p)


def test_defaults_are_the_dataclasses():
    loaded = load(None, environ={}, flags={"data_dir": "/d"})
    assert loaded.broker == BrokerConfig(StoreConfig("/d"))
    assert (loaded.log_level, loaded.log_format) == ("INFO", "text")
    assert loaded.sources == {"data_dir": "command line"}


def test_precedence_file_env_flags(tmp_path):
    path = write(tmp_path, 'data_dir = "/file"\nport = 1111\nflush = "sync"\n'
                           'dedup_window_s = 5\nmetrics_port = 9100\nlog_format = "json"\n')
    env = {"ONCEQ_PORT": "2222", "ONCEQ_FLUSH": "async", "ONCEQ_ACCESS_LOCK": "false",
           "ONCEQ_BROKER": "not-a-setting:1"}  # a client variable: ignored here
    loaded = load(path, environ=env, flags={"port": 3333})
    cfg = loaded.broker
    assert cfg.store.data_dir == "/file"  # file only
    assert cfg.store.dedup_window_s == 5.0 and isinstance(cfg.store.dedup_window_s, float)
    assert cfg.store.flush == "async"  # env over file
    assert cfg.port == 3333  # flag over env over file
    assert cfg.access_lock is False  # env only
    assert cfg.metrics_port == 9100
    assert loaded.log_format == "json"
    assert loaded.sources["port"] == "command line"
    assert loaded.sources["flush"] == "environment"
    assert loaded.sources["data_dir"] == f"config file {path}"
    # without the flag, the environment wins; without both, the file
    assert load(path, environ=env).broker.port == 2222
    assert load(path, environ={}).broker.port == 1111


@pytest.mark.parametrize(("text", "message"), [
    ('data_dir = "/d"\nportt = 1\n', r"key 'portt': unknown key"),
    ('data_dir = "/d"\n[store]\nflush = "sync"\n', r"key 'store': unknown key \(keys are flat"),
    ('data_dir = "/d"\nport = "9876"\n', r"key 'port': expected an integer, got '9876'"),
    ('data_dir = "/d"\nport = true\n', r"key 'port': expected an integer, got True"),
    ('data_dir = "/d"\naccess_lock = 1\n', r"key 'access_lock': expected a boolean, got 1"),
    ('data_dir = "/d"\nretention_hours = "72"\n', r"key 'retention_hours': expected a number"),
    ('data_dir = "/d"\nretention_hours = inf\n', r"key 'retention_hours': must be a finite"),
    ('data_dir = 5\n', r"key 'data_dir': expected a string, got 5"),
    ('data_dir = "/d"\nport = 70000\n', r"key 'port': must be <= 65535, got 70000"),
    ('data_dir = "/d"\nfd_reserve = 2\n', r"key 'fd_reserve': must be >= 16, got 2"),
    ('data_dir = "/d"\nmetrics_port = -2\n', r"key 'metrics_port': must be >= -1"),
    ('data_dir = "/d"\nflush = "never"\n', r"key 'flush': must be one of async, sync"),
    ('data_dir = "/d"\nlog_format = "xml"\n', r"key 'log_format': must be one of text, json"),
    ('data_dir = "/d"\nport = \n', r"not valid TOML"),
])
def test_file_errors_name_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as e:
        load(path, environ={})
    assert path in str(e.value)


def test_missing_or_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        read_file(str(tmp_path / "absent.toml"))
    with pytest.raises(ConfigError, match="cannot read it"):
        read_file(str(tmp_path))  # a directory


@pytest.mark.parametrize(("env", "message"), [
    ({"ONCEQ_PORT": "abc"}, r"environment ONCEQ_PORT: expected an integer, got 'abc'"),
    ({"ONCEQ_PORT": "-5"}, r"environment ONCEQ_PORT: must be >= 0"),
    ({"ONCEQ_ACCESS_LOCK": "maybe"}, r"environment ONCEQ_ACCESS_LOCK: expected a boolean"),
    ({"ONCEQ_DISK_MAX_USED_RATIO": "1.5"}, r"ONCEQ_DISK_MAX_USED_RATIO: must be <= 1"),
    ({"ONCEQ_LOG_LEVEL": "LOUD"}, r"ONCEQ_LOG_LEVEL: must be one of DEBUG"),
    ({"ONCEQ_RETENTION_HOURS": "nan"}, r"ONCEQ_RETENTION_HOURS: must be a finite number"),
])
def test_env_errors_name_the_variable(env, message):
    with pytest.raises(ConfigError, match=message):
        load(None, environ={"ONCEQ_DATA_DIR": "/d", **env})


def test_required_and_cross_field_errors():
    with pytest.raises(ConfigError, match="data_dir is required"):
        load(None, environ={})
    with pytest.raises(ConfigError, match="segment_size must exceed max_body"):
        load(None, environ={}, flags={"data_dir": "/d", "segment_size": 65536,
                                      "max_body": 65536})
    with pytest.raises(ConfigError, match="access_lock_hold_s must exceed long_poll_max_s"):
        load(None, environ={"ONCEQ_DATA_DIR": "/d", "ONCEQ_ACCESS_LOCK_HOLD_S": "10"})
    with pytest.raises(ConfigError, match="bad delay level"):
        load(None, environ={"ONCEQ_DATA_DIR": "/d", "ONCEQ_DELAY_LEVELS": "1x"})


def test_text_values():
    assert parse_text(BY_KEY["access_lock"], " Yes ", "x") is True
    assert parse_text(BY_KEY["access_lock"], "0", "x") is False
    assert parse_text(BY_KEY["segment_size"], "1_048_576", "x") == 1 << 20
    assert parse_text(BY_KEY["log_level"], "debug", "x") == "DEBUG"
    with pytest.raises(ConfigError, match=r"--port: expected an integer, got '1\.5'"):
        parse_text(BY_KEY["port"], "1.5", "--port")


@given(st.integers(min_value=-(10 ** 6), max_value=10 ** 6))
def test_int_bounds_property(value):
    s = BY_KEY["default_queues"]  # 1..1024
    if 1 <= value <= 1024:
        assert parse_text(s, str(value), "k") == value
    else:
        with pytest.raises(ConfigError, match="k: must be"):
            parse_text(s, str(value), "k")


def test_every_setting_is_documented_with_its_default():
    doc = DOCS.read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| [^|]* \| `([^`]*)` \|", doc, re.M))
    for s in SETTINGS:
        assert "(undocumented)" not in s.help, s.key
        assert s.key in rows, f"{s.key} missing from docs/config.md"
        expected = "required" if s.default is None else (
            str(s.default).lower() if isinstance(s.default, bool) else str(s.default))
        assert rows[s.key] == expected, (s.key, rows[s.key], expected)
        assert s.env in doc
    assert set(rows) == {s.key for s in SETTINGS}


def test_printed_config_reads_back(tmp_path):
    from onceq.cli.broker_start import to_toml

    loaded = load(None, environ={"ONCEQ_DELAY_LEVELS": "1s 5s"},
                  flags={"data_dir": str(tmp_path / 'a "b" \\c'), "flush": "sync", "port": 0,
                         "retention_hours": 0.00001, "access_lock": False})
    path = write(tmp_path, to_toml(loaded))
    again = load(path, environ={})
    assert again.broker == loaded.broker
    assert (again.log_level, again.log_format) == (loaded.log_level, loaded.log_format)
