"""The ``onceq`` command line, run as a subprocess against a broker in a child process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence

import pytest

from tests.helpers import free_port, module_broker, spawn_broker

CLI = [sys.executable, "-m", "onceq.cli.main"]
ENV = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
ENV.pop("ONCEQ_BROKER", None)


def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env=ENV)


def run_many(commands: Sequence[Sequence[str]], timeout: float = 30
             ) -> list[subprocess.CompletedProcess[str]]:
    """Run independent commands in parallel (interpreter start-up dominates their cost)."""
    procs = [subprocess.Popen([*CLI, *c], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=ENV) for c in commands]
    out = []
    for c, p in zip(commands, procs, strict=True):
        stdout, stderr = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess([*CLI, *c], p.returncode, stdout, stderr))
    return out


@pytest.fixture(scope="module")
def baddr(tmp_path_factory) -> Iterator[str]:
    yield from module_broker(tmp_path_factory, "cli")


def ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, (r.args, r.stdout, r.stderr)
    return r.stdout


def table_rows(out: str) -> list[list[str]]:
    """Cells of the data rows of a rich table."""
    rows = []
    for line in out.splitlines():
        if "│" in line:
            rows.append([c.strip() for c in line.strip().strip("│").split("│")])
    return rows


def test_topic_create_list_delete(baddr):
    out = ok(run("topic", "create", "cli-orders", "--queues", "3", "-b", baddr))
    assert out.strip() == "topic cli-orders: 3 queues"
    ok(run("topic", "create", "cli-other", "-b", baddr))
    assert ["cli-orders", "3", "0"] in table_rows(ok(run("topic", "list", "-b", baddr)))
    assert ok(run("topic", "delete", "cli-other", "-b", baddr)).strip() == \
        "topic cli-other deleted"
    rows = table_rows(ok(run("topic", "list", "-b", baddr)))
    assert ["cli-orders", "3", "0"] in rows
    assert not [r for r in rows if r[0] == "cli-other"]
    # deleting it again is a broker error
    r = run("topic", "delete", "cli-other", "-b", baddr)
    assert r.returncode == 2
    assert "TOPIC_NOT_EXIST" in r.stderr and "cli-other" in r.stderr


def test_send_pull_offsets(baddr):
    ok(run("topic", "create", "cli-t", "-q", "2", "-b", baddr))
    out = ok(run("send", "cli-t", "hello world", "--tags", "TagA", "--keys", "k1 k2",
                 "--property", "trace=abc", "--property", "empty=", "--sharding-key", "s1",
                 "-n", "3", "-b", baddr))
    sent = re.findall(r"^sent ([0-9A-F]+) -> cli-t\[(\d)\]@(\d+)$", out, re.M)
    assert len(sent) == 3
    q = sent[0][1]
    assert [s[1] for s in sent] == [q] * 3 and [s[2] for s in sent] == ["0", "1", "2"]
    ok(run("send", "cli-t", "other tag", "--tags", "TagB", "--sharding-key", "s1", "-b", baddr))

    out = ok(run("pull", "cli-t", "-b", baddr))
    lines = out.splitlines()
    assert len(lines) == 4
    assert lines[0] == f"cli-t[{q}]@0 key={sent[0][0]} tags='TagA' hello world"
    assert lines[3].endswith("tags='TagB' other tag")
    # tag filter, start offset, max, explicit queue
    out = ok(run("pull", "cli-t", "--tags", "TagB", "-b", baddr))
    assert out.splitlines() == [line for line in lines if "TagB" in line]
    out = ok(run("pull", "cli-t", "-q", q, "--offset", "2", "--max", "1", "-b", baddr))
    assert out.splitlines() == [lines[2]]

    # offsets with a group: nothing committed yet, then committed via the client library
    rows = table_rows(ok(run("offsets", "cli-t", "--group", "cli-g", "-b", baddr)))
    assert rows[int(q)] == [q, "0", "4", "-", "4"]  # nothing committed
    subprocess.run([sys.executable, "-c", (
        "from onceq import SyncPullConsumer\n"
        f"c = SyncPullConsumer({baddr!r}, 'cli-g')\n"
        f"c.commit_offset('cli-t', {q}, 3)\n"
        "c.close()\n")], check=True, timeout=30)
    rows = table_rows(ok(run("offsets", "cli-t", "-g", "cli-g", "-b", baddr)))
    assert rows[int(q)] == [q, "0", "4", "3", "1"]
    rows = table_rows(ok(run("offsets", "cli-t", "-b", baddr)))
    assert rows[int(q)] == [q, "0", "4"]


def test_pull_tag_filter_scans_past_unmatched_messages(baddr):
    ok(run("topic", "create", "cli-filter", "-q", "1", "-b", baddr))
    ok(run("send", "cli-filter", "noise", "--tags", "B", "-n", "300", "-b", baddr))
    ok(run("send", "cli-filter", "needle", "--tags", "A", "-b", baddr))
    out = ok(run("pull", "cli-filter", "--tags", "A", "-b", baddr))
    assert out.splitlines() == [line for line in out.splitlines() if "needle" in line]
    assert len(out.splitlines()) == 1


def test_errors_and_exit_codes(baddr):
    dead = f"127.0.0.1:{free_port()}"
    results = run_many([
        ("send", "no-such-topic", "x", "-b", baddr),  # 0
        ("pull", "no-such-topic", "-b", baddr),  # 1
        ("offsets", "no-such-topic", "-b", baddr),  # 2
        ("topic", "create", "bad name", "-b", baddr),  # 3
        ("topic", "list", "-b", dead),  # 4
        ("send", "t", "x", "-b", dead),  # 5
        ("send", "t", "x", "-b", "not-an-address"),  # 6
        ("send", "t", "x", "--property", "novalue", "-b", baddr),  # 7
        ("topic", "create", "t", "--queues", "0", "-b", baddr),  # 8
        ("pull", "t", "--max", "zero", "-b", baddr),  # 9
        ("send",),  # 10
        ("no-such-command",),  # 11
        ("pull", "cli-t", "-q", "0", "--offset", "999", "-b", baddr),  # 12
        ("pull", "cli-t", "-q", "77", "-b", baddr),  # 13
        ("offsets", "cli-t", "-g", "bad group", "-b", baddr),  # 14
        ("send", "t", "x", "-b", "127.0.0.1:70000"),  # 15
    ])
    codes = [r.returncode for r in results]
    assert codes == [2, 2, 2, 2, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2], [
        (r.args[3:], r.returncode, r.stderr[-300:]) for r in results]
    for r in results:
        assert "Traceback" not in r.stderr, r.stderr
    assert "error: TOPIC_NOT_EXIST" in results[0].stderr
    assert "'no-such-topic' does not exist" in results[0].stderr
    assert "TOPIC_NOT_EXIST" in results[1].stderr and "TOPIC_NOT_EXIST" in results[2].stderr
    assert "INVALID_NAME" in results[3].stderr
    for r in results[4:6]:
        assert "cannot connect to broker" in r.stderr and dead in r.stderr
    assert "host:port" in results[6].stderr and "Usage:" in results[6].stderr
    assert "is not K=V" in results[7].stderr
    assert "Usage:" in results[10].stderr
    assert "beyond the end" in results[12].stderr
    assert "INVALID_QUEUE" in results[13].stderr
    assert "INVALID_NAME" in results[14].stderr
    assert "65535" in results[15].stderr
    # the CLI's --broker also comes from the environment
    env = {**ENV, "ONCEQ_BROKER": dead}
    r = subprocess.run([*CLI, "topic", "list"], capture_output=True, text=True, env=env,
                       timeout=30)
    assert r.returncode == 3


COMMANDS = [(), ("broker",), ("broker", "start"), ("topic",), ("topic", "create"),
            ("topic", "list"), ("topic", "delete"), ("send",), ("pull",), ("offsets",),
            ("demo",)]


def test_help_for_every_command():
    results = run_many([(*c, "--help") for c in COMMANDS] + [("-h",), ("--version",)])
    for c, r in zip(COMMANDS, results, strict=False):
        assert r.returncode == 0, (c, r.stderr)
        assert r.stdout.startswith("Usage:"), c
        assert "--help" in r.stdout
    assert "--broker" in results[COMMANDS.index(("send",))].stdout
    assert "--data-dir" in results[COMMANDS.index(("broker", "start"))].stdout
    assert results[-2].returncode == 0 and results[-2].stdout.startswith("Usage:")
    assert results[-1].returncode == 0 and "0.1.0" in results[-1].stdout


def test_broker_start_refuses_bad_config(tmp_path):
    port = str(free_port())
    results = run_many([
        ("broker", "start", "-d", str(tmp_path / "a"), "-p", port, "--max-body", "2000000",
         "--segment-size", "1000000"),
        ("broker", "start", "-d", str(tmp_path / "b"), "-p", "70000"),
        ("broker", "start", "-p", port),
        ("broker", "start", "-d", str(tmp_path / "c"), "-p", port, "--max-output-bytes",
         "1000000"),
        ("broker", "start", "-d", str(tmp_path / "d"), "-p", port, "--read-timeout", "-1"),
        ("broker", "start", "-d", str(tmp_path / "e"), "-p", port,
         "--max-input-buffer-bytes", "1000"),
        ("broker", "start", "-d", str(tmp_path / "f"), "-p", port, "--fd-reserve", "2"),
    ])
    assert [r.returncode for r in results] == [2] * 7
    assert "segment_size" in results[0].stderr
    assert "max_output_bytes must exceed" in results[3].stderr
    assert "--read-timeout" in results[4].stderr
    assert "max_input_buffer_bytes" in results[5].stderr
    assert "--fd-reserve" in results[6].stderr
    for r in results:
        assert "Traceback" not in r.stderr


def test_broker_start_on_a_busy_port(tmp_path, baddr):
    port = baddr.rsplit(":", 1)[1]
    r = run("broker", "start", "-d", str(tmp_path / "busy"), "-p", port, "--log-level",
            "WARNING")
    assert r.returncode == 1
    assert "cannot start broker" in r.stderr and "Traceback" not in r.stderr


def test_broker_stops_cleanly_on_sigterm(tmp_path):
    data = str(tmp_path / "data")
    proc, addr = spawn_broker(data, "--flush-interval-ms", "60000")
    try:
        ok(run("topic", "create", "sig", "-q", "1", "-b", addr))
        ok(run("send", "sig", "before stop", "-b", addr))
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(10)
        err = proc.stderr.read().decode()
    assert rc == 0, err
    assert "Traceback" not in err
    proc, addr = spawn_broker(data)
    try:
        out = ok(run("pull", "sig", "-b", addr))
        assert out.rstrip().endswith("before stop")
    finally:
        proc.terminate()
        proc.wait(10)


def test_dedup_max_keys_flag_and_status(tmp_path):
    """--dedup-max-keys bounds the window; the status shows the window it leaves, and the
    broker warns (once a minute) that the cap cut it short."""
    data = str(tmp_path / "data")
    proc, addr = spawn_broker(data, "--dedup-max-keys", "5", "--dedup-window", "600")
    try:
        ok(run("topic", "create", "dd", "-q", "1", "-b", addr))
        out = ok(run("broker", "status", "-b", addr))
        assert "dedup window 600 s (effective 600 s), 0 keys of at most 5" in out
        ok(run("send", "dd", "m", "-n", "12", "-b", addr))
        st = json.loads(ok(run("broker", "status", "-b", addr, "--json")))
        dd = st["dedup"]
        assert dd["keys"] == 5 and dd["max_keys"] == 5 and dd["window_s"] == 600
        assert 0 <= dd["effective_window_s"] < 60
        # the warning is among the broker's recent ones, in the JSON and the text
        assert [e["level"] for e in st["recent_errors"]
                if "holds its maximum of 5 keys" in e["message"]] == ["WARNING"]
        out = ok(run("broker", "status", "-b", addr))
        assert "warning(s) and error(s) since the broker started, the newest:" in out
        assert "dedup window holds its maximum of 5 keys" in out.split("the newest:")[1]
    finally:
        proc.terminate()
        proc.wait(10)
        err = proc.stderr.read().decode()
    assert err.count("dedup window holds its maximum of 5 keys") == 1, err


def test_offsets_reset(baddr):
    ok(run("topic", "create", "cli-reset", "-q", "2", "-b", baddr))
    ok(run("send", "cli-reset", "m", "-n", "6", "--sharding-key", "k", "-b", baddr))
    base = ("offsets", "reset", "-g", "cli-rg", "-t", "cli-reset", "-b", baddr)
    results = [run(*base, "--to-offset", "100"),  # one after the other: they change state
               run(*base, "--to-offset", "0", "--queue", "1", "--json"),
               run(*base, "--to-time", "2000-01-01T00:00:00", "--json")]
    results += run_many([
        (*base,),  # neither --to-offset nor --to-time
        (*base, "--to-time", "yesterday"),
        (*base, "--to-offset", "1", "--queue", "9"),
        ("offsets", "cli-reset", "-b", baddr),  # the old form still shows offsets
        ("offsets", "reset", "--help"),
        (*base, "--to-offset", str(2**70)),  # wider than the wire's 64 bits
    ])
    rows = table_rows(ok(results[0]))
    assert sorted(r[0] for r in rows) == ["0", "1"] and all(r[1] == "-" for r in rows)
    assert sorted(int(r[2]) for r in rows) == [0, 6]  # clamped to each queue's max
    assert json.loads(ok(results[1]))["queues"][0]["queue"] == 1
    assert [q["new"] for q in json.loads(ok(results[2]))["queues"]] == [0, 0]
    assert results[3].returncode == 2 and "exactly one" in results[3].stderr
    assert results[4].returncode == 2 and "ISO 8601" in results[4].stderr
    assert results[5].returncode == 2 and "INVALID_QUEUE" in results[5].stderr
    assert len(table_rows(ok(results[6]))) == 2
    assert "--force" in ok(results[7])
    assert results[8].returncode == 2 and "Traceback" not in results[8].stderr
    assert "--to-offset" in results[8].stderr
    # a live member: refused without --force, and --force goes through
    member = subprocess.Popen([sys.executable, "-c", (
        "import asyncio, sys\n"
        "from onceq import PushConsumer\n"
        "async def main():\n"
        f"    c = PushConsumer({baddr!r}, 'cli-rg', lambda m, c: None)\n"
        "    c.subscribe('cli-reset')\n"
        "    await c.start()\n"
        "    print('ready', flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n")], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert member.stdout.readline().strip() == "ready"
        refused = run(*base, "--to-offset", "2")
        assert refused.returncode == 2 and "GROUP_ACTIVE" in refused.stderr
        out = json.loads(ok(run(*base, "--to-offset", "2", "--force", "--json")))
        assert sorted(q["new"] for q in out["queues"]) == [0, 2]
    finally:
        member.kill()
        member.wait(10)


def test_demo_refuses_a_report_it_cannot_write_before_it_runs(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    results = run_many([("demo", "--no-spark", "--report", str(blocker / "r.html")),
                        ("demo", "--contrast-orders", "5")])
    assert [r.returncode for r in results] == [2, 2]
    assert "--report" in results[0].stderr and "cannot create its directory" in results[0].stderr
    assert "at least 20" in results[1].stderr


def test_demo_stops_with_a_clear_word_when_the_broker_refuses_writes(tmp_path):
    env = {**ENV, "ONCEQ_DISK_MAX_USED_RATIO": "0.0001"}  # any real disk is above it
    r = subprocess.run([*CLI, "demo", "-n", "40", "--contrast-orders", "0", "--no-spark",
                        "--report", str(tmp_path / "r.html")], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "the broker refuses writes" in r.stdout and "Traceback" not in r.stderr
    assert not (tmp_path / "r.html").exists()
