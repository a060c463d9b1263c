"""``onceq broker start`` with a config file, environment overrides and flags, JSON logs and
the metrics endpoint, run as a user would (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence

from onceq.broker.settings import ENV_PREFIX
from tests.helpers import free_port

CLI = [sys.executable, "-m", "onceq.cli.main"]
BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}


def run_many(commands: Sequence[tuple[Sequence[str], dict[str, str]]]
             ) -> list[subprocess.CompletedProcess[str]]:
    procs = [subprocess.Popen([*CLI, *c], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**BASE_ENV, **env}) for c, env in commands]
    out = []
    for (c, _env), p in zip(commands, procs, strict=True):
        stdout, stderr = p.communicate(timeout=60)
        out.append(subprocess.CompletedProcess(c, p.returncode, stdout, stderr))
    return out


def settings(stdout: str) -> dict[str, tuple[str, str]]:
    """``--print-config`` output: key -> (value, source)."""
    out = {}
    for line in stdout.splitlines():
        kv, _, source = line.partition("  # ")
        key, _, value = kv.partition(" = ")
        out[key] = (value, source)
    return out


def test_precedence_and_errors(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text(f'data_dir = "{tmp_path / "d"}"\nport = 1111\nflush = "sync"\n'
                    'retention_hours = 1\n')
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('data_dir = "x"\nretention_hour = 1\n')
    typed = tmp_path / "typed.toml"
    typed.write_text('data_dir = "x"\naccess_lock = "no"\n')
    broken = tmp_path / "broken.toml"
    broken.write_text('data_dir = "x\n')
    cfg = ["broker", "start", "--print-config", "--config"]
    results = run_many([
        ([*cfg, str(good)], {}),
        ([*cfg, str(good)], {"ONCEQ_PORT": "2222", "ONCEQ_FLUSH": "async"}),
        ([*cfg, str(good), "--port", "3333", "--no-access-lock"], {"ONCEQ_PORT": "2222"}),
        (["--log-level", "debug", "broker", "start", "--print-config"],
         {"ONCEQ_CONFIG": str(good)}),
        ([*cfg, str(unknown)], {}),
        ([*cfg, str(typed)], {}),
        ([*cfg, str(broken)], {}),
        ([*cfg, str(tmp_path / "absent.toml")], {}),
        ([*cfg, str(good)], {"ONCEQ_MAX_BODY": "big"}),
        ([*cfg, str(good), "--port", "seventy"], {}),
        ([*cfg, str(good), "--retention-hours", "-1"], {}),
        (["broker", "start", "--print-config"], {}),
        ([*cfg, str(good), "--segment-size", "65536"], {}),
        (["broker", "start", "--data-dir", str(tmp_path / "d2"), "--port", "0",
          "--tls-cert", str(tmp_path / "absent.pem")], {}),
    ])
    for r in results[:4]:
        assert r.returncode == 0, (r.args, r.stderr)
    s = [settings(r.stdout) for r in results[:4]]
    assert s[0]["port"] == ("1111", f"config file {good}")
    assert s[0]["flush"] == ('"sync"', f"config file {good}")
    assert s[0]["retention_hours"] == ("1.0", f"config file {good}")
    assert s[0]["access_lock"] == ("true", "default")
    assert s[1]["port"] == ("2222", "environment")
    assert s[1]["flush"] == ('"async"', "environment")
    assert s[2]["port"] == ("3333", "command line")
    assert s[2]["access_lock"] == ("false", "command line")
    assert s[3]["log_level"] == ('"DEBUG"', "command line")
    assert s[3]["port"] == ("1111", f"config file {good}")

    errors = results[4:]
    assert [r.returncode for r in errors] == [2] * len(errors)
    for r in errors:
        assert r.stderr.startswith("error: "), r.stderr
        assert "Traceback" not in r.stderr
    expected = [
        "key 'retention_hour': unknown key",
        "key 'access_lock': expected a boolean, got 'no'",
        "not valid TOML",
        "cannot read it",
        "environment ONCEQ_MAX_BODY: expected an integer, got 'big'",
        "--port: expected an integer, got 'seventy'",
        "--retention-hours: must be >= 0, got -1.0",
        "data_dir is required",
        "segment_size must exceed max_body",
        f"tls_cert/tls_key: cannot load {tmp_path / 'absent.pem'}",
    ]
    for r, text in zip(errors, expected, strict=True):
        assert text in r.stderr, (text, r.stderr)


def test_broker_from_a_config_file_logs_json_and_serves_metrics(tmp_path):
    port, mport = free_port(), free_port()
    conf = tmp_path / "onceq.toml"
    conf.write_text(f'data_dir = "{tmp_path / "data"}"\nport = {port}\n'
                    f'metrics_port = {mport}\nlog_format = "json"\nlog_level = "INFO"\n')
    log_path = tmp_path / "broker.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*CLI, "broker", "start", "--config", str(conf)],
                                stdout=subprocess.DEVNULL, stderr=log, env=BASE_ENV)
    try:
        deadline = time.monotonic() + 30
        body = None
        while body is None:
            assert proc.poll() is None, log_path.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=2) as r:
                    body = r.read().decode()
            except OSError:
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)
        assert "onceq_send_latency_seconds_bucket" in body
        assert "onceq_disk_used_bytes" in body
        r = subprocess.run([*CLI, "topic", "create", "J", "-q", "1", "-b", f"127.0.0.1:{port}"],
                           capture_output=True, text=True, env=BASE_ENV, timeout=30)
        assert r.returncode == 0, r.stderr
        # a client command: `onceq --log-format json`, the command's own --log-level
        addr = f"127.0.0.1:{port}"
        r = subprocess.run([*CLI, "send", "J", "hello", "-b", addr], capture_output=True,
                           text=True, env=BASE_ENV, timeout=30)
        assert r.returncode == 0, r.stderr
        r = subprocess.run([*CLI, "--log-format", "json", "consume", "J", "-g", "g1", "-n", "1",
                            "--from", "first", "--log-level", "INFO", "-b", addr],
                           capture_output=True, text=True, env=BASE_ENV, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "hello" in r.stdout
        logged = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
        assert any("rebalance" in rec["message"] and rec["level"] == "INFO"
                   for rec in logged), r.stderr
    finally:
        proc.terminate()
        proc.wait(30)
    lines = log_path.read_text().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    messages = [rec["message"] for rec in records]
    assert any(m.startswith(f"broker listening on 127.0.0.1:{port}") for m in messages)
    assert any(m.startswith("metrics on http://127.0.0.1:") for m in messages)
    assert "topic J created/updated with 1 queues" in messages
    assert any(m == "broker stopped" for m in messages)
    for rec in records:
        assert set(rec) >= {"ts", "level", "logger", "message"}
        assert rec["level"] in ("INFO", "WARNING", "ERROR")
    assert len(records) == len(lines)  # nothing but JSON on stderr
