"""``onceq consume``, ``onceq group`` and ``onceq dlq`` as subprocesses against a child broker."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from onceq import Message, SyncProducer
from onceq.client.allocation import MessageQueue, allocate_average
from tests.helpers import admin, free_port, module_broker
from tests.integration.test_cli import CLI, ENV, ok, run, run_many, table_rows

LINE = re.compile(r"^(\S+)\[(\d+)\]@(\d+) key=([0-9A-F]+) tags='([^']*)' reconsume=(\d+) (.*)$")


@pytest.fixture(scope="module")
def baddr(tmp_path_factory) -> Iterator[str]:
    yield from module_broker(tmp_path_factory, "clic", "--delay-levels",
                             "50ms 50ms 50ms 50ms 50ms")


def send(addr: str, topic: str, bodies: list[str], **kw) -> list:
    with SyncProducer(addr) as p:
        return [p.send(topic, Message(b.encode(), **kw.get("msg", {})), **kw.get("send", {}))
                for b in bodies]


class Consumer:
    """``onceq consume`` in the background; its stdout lines are collected by a thread."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([*CLI, "consume", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env or ENV)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_lines(self, n: int, timeout: float = 15) -> list[str]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.lines) >= n, timeout), self.lines
            return list(self.lines)

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        self.proc.send_signal(sig)
        rc = self.proc.wait(20)
        self._t.join(5)
        assert self.proc.stderr is not None
        return rc, self.proc.stderr.read()


def wait_members(addr: str, group: str, n: int, timeout: float = 15) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            members = admin(addr, lambda a: a.group_members(group))
        except Exception:  # GROUP_NOT_EXIST until the first heartbeat
            members = []
        if len(members) >= n or time.monotonic() > deadline:
            assert len(members) == n, members
            return members
        time.sleep(0.05)


def wait_locks(addr: str, group: str, topic: str, want: dict[int, str],
               timeout: float = 15) -> None:
    """Wait until the access lock of each queue ``q`` of ``topic`` is held by ``want[q]``
    (no handover pending)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = admin(addr, lambda a: a.access_locks(group))
        got = {r["queue"]: r["holder"] for r in rows
               if r["topic"] == topic and not r["pending_handover"]}
        if got == want:
            return
        assert time.monotonic() < deadline, rows
        time.sleep(0.05)


def test_consume_count_prints_messages(baddr, tmp_path):
    ok(run("topic", "create", "cc", "-q", "2", "-b", baddr))
    sent = send(baddr, "cc", [f"a{i}" for i in range(4)], msg={"tags": "A"})
    sent += send(baddr, "cc", ["b0", "b1"], msg={"tags": "B"})
    results = run_many([
        ("consume", "cc", "-g", "cc-g", "--from", "first", "-n", "6", "-b", baddr),
        ("consume", "cc", "-g", "cc-tags", "--from", "first", "--tags", "B", "-n", "2",
         "-b", baddr),
        ("consume", "cc", "-g", "cc-bc", "--broadcast", "--offset-dir", str(tmp_path),
         "--from", "first", "-n", "6", "--batch-size", "3", "-b", baddr),
    ])
    out = ok(results[0])
    got = [LINE.match(line) for line in out.splitlines()]
    assert all(got) and len(got) == 6, out
    by_key = {m[4]: m for m in got}
    for r in sent:
        m = by_key[r.unique_key]
        assert (m[1], int(m[2]), int(m[3])) == ("cc", r.queue_id, r.offset)
        assert m[6] == "0"
    assert sorted(m[7] for m in got) == ["a0", "a1", "a2", "a3", "b0", "b1"]
    assert {m[5] for m in got if m[7].startswith("a")} == {"A"}
    assert "consumed 6 message(s)" in results[0].stderr
    assert sorted(line.rsplit(" ", 1)[1] for line in ok(results[1]).splitlines()) == \
        ["b0", "b1"]
    assert len(ok(results[2]).splitlines()) == 6
    files = os.listdir(tmp_path)
    assert len(files) == 1 and "cc-bc" in files[0]
    with open(tmp_path / files[0]) as f:
        assert sum(json.load(f).values()) == 6  # local offsets of the broadcast member

    # the graceful stop committed everything: no lag, nothing delivered again
    rows = table_rows(ok(run("group", "status", "cc-g", "-b", baddr)))
    cc_rows = [r for r in rows if r[0] == "cc"]
    assert len(cc_rows) == 2
    for r in cc_rows:
        # max == committed, no lag, lock released, no expected owner
        assert r[2] == r[4] and r[5] == "0" and r[6] == "-" and r[8] == "-"
    send(baddr, "cc", ["later"])
    out = ok(run("consume", "cc", "-g", "cc-g", "-n", "1", "-b", baddr))
    assert out.rstrip().endswith("reconsume=0 later")


def test_count_leaves_the_rest_to_the_next_run(baddr):
    ok(run("topic", "create", "cx", "-q", "2", "-b", baddr))
    send(baddr, "cx", [f"x{i}" for i in range(7)])
    bodies = []
    for n in (3, 4):  # messages pulled past --count are neither acknowledged nor retried
        out = ok(run("consume", "cx", "-g", "cx-g", "--from", "first", "-n", str(n),
                     "-b", baddr))
        bodies += [line.rsplit(" ", 1)[1] for line in out.splitlines()]
        assert len(out.splitlines()) == n
    assert sorted(bodies) == [f"x{i}" for i in range(7)]
    rows = [r for r in table_rows(ok(run("group", "status", "cx-g", "-b", baddr)))
            if r[0] == "cx"]
    assert [r[5] for r in rows] == ["0", "0"]


def test_consume_until_signal_and_group_status(baddr):
    ok(run("topic", "create", "gs", "-q", "3", "-b", baddr))
    c1 = Consumer("gs", "-g", "gs-g", "-b", baddr)
    wait_members(baddr, "gs-g", 1)
    c2 = Consumer("gs", "-g", "gs-g", "-b", baddr)
    members = wait_members(baddr, "gs-g", 2)
    by_pid = {c1.proc.pid: c1, c2.proc.pid: c2}
    ids = sorted(m["client"] for m in members)
    # both members rebalance at once on the broker's notification: each queue's access
    # lock passes to its expected owner
    gs_queues = [MessageQueue("gs", q) for q in range(3)]
    wait_locks(baddr, "gs-g", "gs", {mq.queue_id: cid for cid in ids
                                     for mq in allocate_average(cid, gs_queues, ids)})
    assert {int(i.split("@")[1].split("#")[0]) for i in ids} == set(by_pid)

    results = run_many([("group", "list", "-b", baddr), ("group", "status", "gs-g", "-b", baddr)])
    glist = {r[0]: r for r in table_rows(ok(results[0]))}
    assert glist["gs-g"][1:3] == ["2", "CLUSTERING"]
    assert "%RETRY%gs-g" in glist["gs-g"][3] and "gs" in glist["gs-g"][3]
    rows = table_rows(ok(results[1]))
    assert "expected owner (AVERAGE)" in results[1].stdout
    assert "last heartbeat" in results[1].stdout
    member_rows = [r for r in rows if r[0] in ids]
    assert sorted(r[0] for r in member_rows) == ids
    for r in member_rows:
        assert r[1] == "CLUSTERING" and "gs:*" in r[2] and float(r[3]) < 15
    owners = {(r[0], int(r[1])): r[8] for r in rows if r[0] in ("gs", "%RETRY%gs-g")}
    mqs = [MessageQueue("gs", q) for q in range(3)]
    for cid in ids:
        for mq in allocate_average(cid, mqs, ids):
            assert owners[("gs", mq.queue_id)] == cid
    assert ("%RETRY%gs-g", 0) not in owners  # created by the group's first send-back
    # access-lock columns: a queue is held by a member (once it pulled) or by nobody
    for r in rows:
        if r[0] == "gs":
            assert r[6] in (*ids, "-") and r[7] in ("pending", "-")

    # each queue's messages go to the member the status named as its expected owner
    for q in range(3):
        send(baddr, "gs", [f"q{q}"], send={"queue": q})
    deadline = time.monotonic() + 15
    while len(c1.lines) + len(c2.lines) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid, c in by_pid.items():
        for line in c.lines:
            m = LINE.match(line)
            assert m, line
            assert f"@{pid}#" in owners[("gs", int(m[2]))], (pid, line, owners)
    assert sorted(len(c.lines) for c in by_pid.values()) == [1, 2]

    rc1, err1 = c1.stop(signal.SIGINT)
    rc2, err2 = c2.stop(signal.SIGTERM)
    assert (rc1, rc2) == (0, 0), (err1, err2)
    assert "SIGINT: stopping" in err1 and "SIGTERM: stopping" in err2
    assert "Traceback" not in err1 + err2
    consumed = [int(re.search(r"consumed (\d+) message", e)[1]) for e in (err1, err2)]
    assert sum(consumed) == 3

    out = ok(run("group", "status", "gs-g", "-b", baddr))
    assert "no member online" in out
    rows = [r for r in table_rows(out) if r[0] == "gs"]
    assert [(r[1], r[2], r[4], r[5]) for r in rows] == [(str(q), "1", "1", "0") for q in range(3)]


def test_failing_handler_dead_letters_and_resend(baddr, tmp_path):
    ok(run("topic", "create", "dq", "-q", "2", "-b", baddr))
    (tmp_path / "dq_handlers.py").write_text(
        "from onceq import ConsumeStatus\n"
        "async def fail(msgs, ctx):\n"
        "    return ConsumeStatus.RECONSUME_LATER\n"
        "def record(msgs, ctx):\n"
        "    with open(__file__ + '.log', 'a') as f:\n"
        "        for m in msgs:\n"
        "            f.write(f'{m.unique_key} {m.reconsume_times}\\n')\n")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV.get("PYTHONPATH", "")])}
    sent = send(baddr, "dq", ["d0", "d1", "d2"])
    keys = sorted(r.unique_key for r in sent)

    # first delivery + 1 retry each, then the dead-letter queue
    r = subprocess.run([*CLI, "consume", "dq", "-g", "dq-g", "--from", "first",
                        "--handler", "dq_handlers:fail", "--max-reconsume", "1", "-n", "6",
                        "-b", baddr], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and "consumed 6 message(s)" in r.stderr

    out = ok(run("dlq", "list", "dq-g", "-b", baddr))
    rows = [row for row in table_rows(out) if row[0].isdigit()]
    assert sorted(row[0] for row in rows) == ["0", "1", "2"]
    assert sorted(row[1] for row in rows) == keys
    for row in rows:
        assert row[2] == "dq" and row[4] == "2" and row[6] in ("d0", "d1", "d2")
        assert row[5].startswith("retries used up")  # the DLQ_REASON property
    assert "3 of 3 dead letter(s)" in out
    assert len([row for row in table_rows(ok(run("dlq", "list", "dq-g", "--max", "2",
                                                    "-b", baddr))) if row[0].isdigit()]) == 2

    out = ok(run("dlq", "resend", "dq-g", "--all", "-b", baddr))
    lines = out.splitlines()
    # back to this group only, through its retry topic
    assert len(lines) == 3 and all(" -> %RETRY%dq-g[0]" in line for line in lines), out
    assert not [line for line in lines if "duplicate" in line]
    # resending again within the dedup window stores nothing new
    out = ok(run("dlq", "resend", "dq-g", "--offset", "1", "-b", baddr))
    assert "(duplicate: already resent)" in out

    # the group consumes the resent messages: same unique keys, reconsume count kept
    r = subprocess.run([*CLI, "consume", "dq", "-g", "dq-g", "--handler",
                        "dq_handlers:record", "-n", "3", "-b", baddr],
                       capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    handled = (tmp_path / "dq_handlers.py.log").read_text().split("\n")
    assert sorted(h for h in handled if h) == [f"{k} 2" for k in keys]


def test_errors_and_exit_codes(baddr, tmp_path):
    (tmp_path / "h_mod.py").write_text("x = 1\ndef ok(msgs, ctx):\n    pass\n")
    (tmp_path / "h_broken.py").write_text("import no_such_dependency_here\n")
    env = {**ENV, "PYTHONPATH": str(tmp_path)}
    dead = f"127.0.0.1:{free_port()}"
    ok(run("topic", "create", "errs", "-q", "1", "-b", baddr))
    cmds = [
        ("consume", "errs", "-g", "e", "--handler", "nocolon", "-b", baddr),  # 0
        ("consume", "errs", "-g", "e", "--handler", "no_such_mod:f", "-b", baddr),  # 1
        ("consume", "errs", "-g", "e", "--handler", "h_mod:missing", "-b", baddr),  # 2
        ("consume", "errs", "-g", "e", "--handler", "h_mod:x", "-b", baddr),  # 3
        ("consume", "errs", "-g", "e", "--handler", "h_broken:f", "-b", baddr),  # 4
        ("consume", "no-such-topic", "-g", "e", "-b", baddr),  # 5
        ("consume", "errs", "-g", "bad group", "-n", "1", "-b", baddr),  # 6
        ("consume", "errs", "-b", baddr),  # 7: no --group
        ("consume", "errs", "-g", "e", "--from", "first", "--timestamp", "5", "-b", baddr),  # 8
        ("group", "status", "no-such-group", "-b", baddr),  # 9
        ("dlq", "list", "no-such-group", "-b", baddr),  # 10
        ("dlq", "resend", "no-such-group", "--all", "-b", baddr),  # 11
        ("dlq", "resend", "e", "-b", baddr),  # 12: neither --offset nor --all
        ("dlq", "resend", "e", "--all", "--offset", "1", "-b", baddr),  # 13
        ("consume", "errs", "-g", "e", "-b", dead),  # 14
        ("group", "list", "-b", dead),  # 15
        ("group", "status", "g", "-b", dead),  # 16
        ("dlq", "list", "g", "-b", dead),  # 17
        ("dlq", "resend", "g", "--all", "-b", dead),  # 18
    ]
    procs = [subprocess.Popen([*CLI, *c], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for c in cmds]
    outs = [p.communicate(timeout=30) for p in procs]
    results = [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]
    codes = [r[0] for r in results]
    assert codes == [2] * 14 + [3] * 5, [(c, r[0], r[2][-300:])
                                         for c, r in zip(cmds, results, strict=True)]
    for _, _, err in results:
        assert "Traceback" not in err, err
    errs = [r[2] for r in results]
    assert "'nocolon' is not module:function" in errs[0]
    assert "no module named 'no_such_mod'" in errs[1]
    assert "has no attribute 'missing'" in errs[2]
    assert "'h_mod:x' is not callable" in errs[3]
    assert "no_such_dependency_here" in errs[4]
    assert all("--handler" in e for e in errs[:5])
    assert "TOPIC_NOT_EXIST" in errs[5]
    assert "INVALID_NAME" in errs[6]
    assert "--group" in errs[7]
    assert "--timestamp goes with --from timestamp" in errs[8]
    for e in errs[9:12]:
        assert "GROUP_NOT_EXIST" in e and "no-such-group" in e
    assert "--offset O (repeatable) or --all" in errs[12] and errs[12] == errs[13]
    for e in errs[14:]:
        assert "cannot connect to broker" in e and dead in e


def test_dlq_of_a_group_without_dead_letters(baddr):
    ok(run("topic", "create", "nodl", "-q", "1", "-b", baddr))
    send(baddr, "nodl", ["x"])
    ok(run("consume", "nodl", "-g", "nodl-g", "--from", "first", "-n", "1", "-b", baddr))
    results = run_many([("dlq", "list", "nodl-g", "-b", baddr),
                        ("dlq", "resend", "nodl-g", "--all", "-b", baddr),
                        ("dlq", "resend", "nodl-g", "--offset", "0", "-b", baddr)])
    assert ok(results[0]).strip() == "group nodl-g has no dead letters"
    assert ok(results[1]).strip() == "group nodl-g has no dead letters"
    assert results[2].returncode == 2
    assert "no dead letter of group 'nodl-g' at offset 0" in results[2].stderr


COMMANDS = [("consume",), ("group",), ("group", "list"), ("group", "status"), ("dlq",),
            ("dlq", "list"), ("dlq", "resend")]


def test_help_for_every_consumer_command():
    results = run_many([(*c, "--help") for c in COMMANDS])
    for c, r in zip(COMMANDS, results, strict=True):
        assert r.returncode == 0, (c, r.stderr)
        assert r.stdout.startswith("Usage:") and "--help" in r.stdout, c
        if len(c) == 2 or c == ("consume",):
            assert "--broker" in r.stdout, c
    assert "--handler" in results[0].stdout and "--count" in results[0].stdout
