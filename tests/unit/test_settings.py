"""Broker settings: precedence of file < environment < flags, and every error path."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceq.broker.config import BrokerConfig
from onceq.broker.settings import (
    BY_KEY,
    SETTINGS,
    ConfigError,
    check_data_dir,
    check_fds,
    check_host,
    load,
    parse_text,
    read_file,
)
from onceq.storage.config import StoreConfig
from tests.helpers import with_fd_limit

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


# ---------------------------------------------------------------- upper bounds
def test_every_numeric_setting_has_both_bounds():
    for s in SETTINGS:
        if s.type in (int, float):
            assert s.min is not None and s.max is not None, s.key
            assert s.min <= s.default <= s.max, s.key


@pytest.mark.parametrize(("env", "message"), [
    # values that used to start a broker that could not work
    ({"ONCEQ_FD_RESERVE": "1000000"}, r"ONCEQ_FD_RESERVE: must be <= 65536, got 1000000"),
    ({"ONCEQ_MAX_BODY": str(2 ** 61)}, r"ONCEQ_MAX_BODY: must be <= 1073741824"),
    ({"ONCEQ_SEGMENT_SIZE": str(2 ** 61)}, r"ONCEQ_SEGMENT_SIZE: must be <= 17179869184"),
    ({"ONCEQ_EXPIRY_CHECK_S": "1e300"}, r"ONCEQ_EXPIRY_CHECK_S: must be <= 86400"),
    ({"ONCEQ_RETENTION_CHECK_S": "1e300"}, r"ONCEQ_RETENTION_CHECK_S: must be <= 86400"),
    ({"ONCEQ_OFFSETS_SAVE_S": "1e300"}, r"ONCEQ_OFFSETS_SAVE_S: must be <= 86400"),
    ({"ONCEQ_FLUSH_INTERVAL_MS": "86400000"}, r"ONCEQ_FLUSH_INTERVAL_MS: must be <= 60000"),
    ({"ONCEQ_CHECKPOINT_INTERVAL_MS": str(10 ** 12)},
     r"ONCEQ_CHECKPOINT_INTERVAL_MS: must be <= 3600000"),
    ({"ONCEQ_IDLE_TIMEOUT_S": "1e300"}, r"ONCEQ_IDLE_TIMEOUT_S: must be <= 86400"),
    ({"ONCEQ_WRITER_EXPIRY_S": "1e300"}, r"ONCEQ_WRITER_EXPIRY_S: must be <= 2592000"),
    ({"ONCEQ_MAX_CONNECTIONS": str(2 ** 40)}, r"ONCEQ_MAX_CONNECTIONS: must be <= 1048576"),
    ({"ONCEQ_MAX_OPEN_FILES": str(2 ** 40)}, r"ONCEQ_MAX_OPEN_FILES: must be <= 1048576"),
    ({"ONCEQ_MAX_PULL_MSGS": str(2 ** 40)}, r"ONCEQ_MAX_PULL_MSGS: must be <= 65536"),
    ({"ONCEQ_RETENTION_HOURS": "1e300"}, r"ONCEQ_RETENTION_HOURS: must be <= 87600"),
])
def test_upper_bounds_name_the_variable(env, message):
    with pytest.raises(ConfigError, match=message):
        load(None, environ={"ONCEQ_DATA_DIR": "/d", **env})


def test_upper_bounds_in_the_file_name_the_key(tmp_path):
    path = write(tmp_path, 'data_dir = "/d"\nfd_reserve = 1000000\n')
    with pytest.raises(ConfigError, match=r"key 'fd_reserve': must be <= 65536"):
        load(path, environ={})


def test_values_at_the_bounds_are_accepted_and_above_refused():
    flags = {"data_dir": "/d", "fd_reserve": 65536, "expiry_check_s": 86400.0,
             "flush_interval_ms": 60_000, "writer_expiry_s": 30 * 86400.0,
             "max_body": 1 << 30, "segment_size": 16 << 30, "max_pull_msgs": 65536}
    cfg = load(None, environ={}, flags=flags).broker
    assert (cfg.fd_reserve, cfg.store.max_body, cfg.store.segment_size) == (
        65536, 1 << 30, 16 << 30)
    for key, value in flags.items():
        if key != "data_dir":
            above = str(value + 1 if isinstance(value, int) else value * 1.001)
            with pytest.raises(ConfigError, match=f"^--x: must be <= {value:.0f}, got"):
                parse_text(BY_KEY[key], above, "--x")


def test_delay_levels_bounds():
    env = {"ONCEQ_DATA_DIR": "/d"}
    levels = " ".join(["1s"] * 1024)  # one schedule queue per level: a topic holds 1024
    assert load(None, environ={**env, "ONCEQ_DELAY_LEVELS": levels}).broker.delay_levels
    with pytest.raises(ConfigError, match=r"ONCEQ_DELAY_LEVELS: at most 1024 delay levels"):
        load(None, environ={**env, "ONCEQ_DELAY_LEVELS": levels + " 1s"})
    assert load(None, environ={**env, "ONCEQ_DELAY_LEVELS": "1s 365d"}).broker
    with pytest.raises(ConfigError, match=r"ONCEQ_DELAY_LEVELS: level 2 is longer than 365d"):
        load(None, environ={**env, "ONCEQ_DELAY_LEVELS": "1s 366d"})
    with pytest.raises(ConfigError, match=r"--delay-levels: level 1 is longer than 365d"):
        load(None, environ=env, flags={"delay_levels": parse_text(
            BY_KEY["delay_levels"], "1" + "0" * 306 + "d", "--delay-levels")})
    with pytest.raises(ConfigError, match=r"ONCEQ_DELAY_LEVELS: bad delay level"):
        load(None, environ={**env, "ONCEQ_DELAY_LEVELS": "1x"})


# ---------------------------------------------------------------- unknown ONCEQ_ variables
def test_unknown_env_variables_are_warned_with_a_suggestion():
    env = {"ONCEQ_DATA_DIR": "/d", "ONCEQ_FD_RESREVE": "1000", "ONCEQ_BROKR": "h:1",
           "ONCEQ_ZZZ": "1", "ONCEQ_BROKER": "h:1", "ONCEQ_CONFIG": "x.toml",
           "ONCEQ_DEDUP_STORE": "redis://", "ONCEQ_LOG_LEVEL": "debug",
           "ONCEQ_DISK_MAX_USED_RATIO": "1.0", "PATH": "/bin", "XONCEQ_PORT": "1"}
    loaded = load(None, environ=env)
    assert loaded.broker.fd_reserve == 128  # the misspelled one changes nothing...
    assert loaded.warnings == [  # ...but is not silent
        "environment ONCEQ_BROKR: not a setting, ignored (did you mean ONCEQ_BROKER?); "
        "see docs/config.md",
        "environment ONCEQ_FD_RESREVE: not a setting, ignored (did you mean "
        "ONCEQ_FD_RESERVE?); see docs/config.md",
        "environment ONCEQ_ZZZ: not a setting, ignored; see docs/config.md"]
    assert load(None, environ={"ONCEQ_DATA_DIR": "/d"}).warnings == []


# ---------------------------------------------------------------- checks at start
def test_check_data_dir(tmp_path):
    check_data_dir(str(tmp_path / "new" / "dir"))  # created
    assert (tmp_path / "new" / "dir").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"^data_dir: .*file exists and is not a directory"):
        check_data_dir(str(tmp_path / "file"))
    with pytest.raises(ConfigError, match=r"^data_dir: cannot create .*file/sub: Not a dir"):
        check_data_dir(str(tmp_path / "file" / "sub"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in any directory")
def test_check_data_dir_not_writable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match=r"^data_dir: cannot write in .*ro: Permission"):
        check_data_dir(str(ro))


def test_check_host():
    check_host("host", "127.0.0.1")
    check_host("host", "localhost")
    check_host("host", "0.0.0.0")
    with pytest.raises(ConfigError, match=r"^host: cannot resolve 'no\.such\.host\.invalid'"):
        check_host("host", "no.such.host.invalid")
    with pytest.raises(ConfigError, match=r"^metrics_host: cannot listen on '192\.0\.2\.1'"):
        check_host("metrics_host", "192.0.2.1")  # TEST-NET-1: no machine's address


def test_check_fds():
    cfg = load(None, environ={}, flags={"data_dir": "/d"}).broker
    check_fds(cfg, soft_limit=1024)  # 128 reserved + 256 cached + 32 own: 608 for clients
    check_fds(cfg, soft_limit=256)
    with pytest.raises(ConfigError, match=r"^fd_reserve: 128 and the index-file cache \(50,"
                                          r" from the limit\) leave 0 of the process's 200"):
        check_fds(cfg, soft_limit=200)
    cfg = load(None, environ={}, flags={"data_dir": "/d", "max_open_files": 1000}).broker
    with pytest.raises(ConfigError, match=r"^fd_reserve: 128 and max_open_files 1000 leave"):
        check_fds(cfg, soft_limit=1024)


def _start(*args: str, env: dict[str, str] | None = None, fd_limit: int | None = None
           ) -> subprocess.Popen[str]:
    environ = {k: v for k, v in os.environ.items() if k != "ONCEQ_BROKER"}
    argv = [sys.executable, "-m", "onceq.cli.main", "broker", "start", "-p", "0", *args]
    return subprocess.Popen(with_fd_limit(argv, fd_limit), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**environ, **(env or {})})


def test_broker_start_host_data_dir_and_fd_errors_exit_2_naming_the_key(tmp_path):
    (tmp_path / "file").write_text("x")
    data = str(tmp_path / "data")
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "queues").write_text("x")  # where the store wants a directory
    cases = [
        (_start("-d", str(tmp_path / "blocked")), r"^error: data_dir: File exists: .*queues$"),
        (_start("-d", str(tmp_path / "file")), r"^error: data_dir: .* is not a directory$"),
        (_start("-d", str(tmp_path / "file" / "sub")), r"^error: data_dir: cannot create"),
        (_start("-d", data, "--host", "no.such.host.invalid"),
         r"^error: host: cannot resolve 'no\.such\.host\.invalid'"),
        (_start("-d", data, "--host", "192.0.2.1"),
         r"^error: host: cannot listen on '192\.0\.2\.1': not an address of this machine"),
        (_start("-d", data, "--metrics-port", "0", "--metrics-host", "no.such.host.invalid"),
         r"^error: metrics_host: cannot resolve"),
        (_start("-d", data, "--fd-reserve", "200", fd_limit=256), r"^error: fd_reserve: 200"),
    ]
    for proc, message in cases:
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 2, (proc.args, stderr)
        assert re.search(message, stderr, re.M), (proc.args, stderr)
        assert "Traceback" not in stderr


def test_broker_start_logs_unknown_env_variables(tmp_path):
    proc = _start("-d", str(tmp_path / "d"), "--host", "no.such.host.invalid",
                  env={"ONCEQ_FD_RESREVE": "1000", "ONCEQ_BROKER": "h:1"})
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2, stderr
    assert re.search(r"WARNING onceq\.broker environment ONCEQ_FD_RESREVE: not a setting, "
                     r"ignored \(did you mean ONCEQ_FD_RESERVE\?\)", stderr), stderr
    assert "ONCEQ_BROKER" not in stderr
