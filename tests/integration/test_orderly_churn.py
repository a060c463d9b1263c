"""Orderly consumption under churn, end to end: child consumer processes joining, leaving
gracefully and one SIGKILLed, while keyed messages flow.

A topic of 8 queues, 1,000 keys, messages ``<key> <seq>`` with a per-key sequence number,
sent with a selector (all messages of a key to one queue). Every member logs each handled
message with the machine's monotonic clock; merged in time order, each key's sequence must
be 0, 1, 2, ... with one exception: after the SIGKILL, messages the killed member handled
but had not committed come again (a suffix repeats, then the sequence goes on). Asserted:
nothing lost, no gap or reordering, and every repeat is of the killed member's messages
(so no duplicate at all without the crash).

``ONCEQ_ORDERLY_MESSAGES`` sets the message count (default 100,000; about 25 s).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import zlib
from collections import defaultdict
from pathlib import Path

import pytest

from onceq import Admin, Producer
from tests.helpers import running_broker

PROC = Path(__file__).resolve().parent.parent / "orderly_proc.py"
QUEUES = 8
KEYS = 1000
MESSAGES = int(os.environ.get("ONCEQ_ORDERLY_MESSAGES", "100000"))
G = "orderly-churn"
T = "ORD"


def _queue_of(n: int, message) -> int:
    key = message.body.split(b" ", 1)[0]
    return zlib.crc32(key) % n


class Member:
    def __init__(self, addr: str, name: str, out: Path) -> None:
        self.name = name
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, str(PROC), "--addr", addr, "--group", G, "--topic", T,
             "--out", str(out), "--client-id", name],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})

    async def ready(self) -> None:
        line = await asyncio.to_thread(self.proc.stdout.readline)
        assert line.startswith(b"READY"), (line, self.proc.stderr.read())

    async def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(self.proc.wait, 60)
        assert rc == 0, self.proc.stderr.read()


def _read(paths: dict[str, Path]) -> list[tuple[int, str, bytes, int]]:
    rows = []
    for name, path in paths.items():
        if not path.exists():
            continue
        for line in path.read_bytes().splitlines():
            t, key, seq = line.split()
            rows.append((int(t), name, key, int(seq)))
    return rows


def _check(rows: list[tuple[int, str, bytes, int]], per_key: int, killed: str,
           killed_at: int) -> dict[str, int]:
    """Per key in time order: 0, 1, 2, ...; a step back only after the kill, only to
    re-handle what the killed member handled, once per key. Returns the counts."""
    by_key: dict[bytes, list[tuple[int, str, int]]] = defaultdict(list)
    for t, name, key, seq in rows:
        by_key[key].append((t, name, seq))
    problems: list[str] = []
    repeats = 0
    keys_repeated = 0
    for key, ds in by_key.items():
        ds.sort()
        first_by: dict[int, str] = {}
        prev = -1
        rewinds = 0
        for t, name, seq in ds:
            if seq == prev + 1 and seq not in first_by:
                first_by[seq] = name
            elif seq <= prev or (seq == prev + 1 and seq in first_by):
                # a repeat: must be the start or the rest of one redelivered suffix of what
                # the killed member handled, after its kill
                if seq <= prev:
                    rewinds += 1
                if (t < killed_at or first_by.get(seq) != killed or rewinds > 1):
                    problems.append(f"{key!r}: seq {seq} again at {t} by {name} "
                                    f"(first by {first_by.get(seq)}, previous {prev})")
                repeats += 1
            else:
                problems.append(f"{key!r}: seq {seq} after {prev} by {name} (gap/reorder)")
            prev = seq
        keys_repeated += rewinds > 0
        if sorted(first_by) != list(range(per_key)):
            problems.append(f"{key!r}: handled {len(first_by)} of {per_key}")
    assert len(by_key) == KEYS, f"{KEYS - len(by_key)} keys never handled"
    assert problems == [], f"{len(problems)} problems, first: {problems[:5]}"
    return {"deliveries": len(rows), "repeats": repeats, "keys_repeated": keys_repeated}


async def _produce(addr: str, rounds: int, pace_s: float) -> None:
    """Round r sends seq r of every key; batches per queue, each key's messages in order."""
    async with Producer(addr) as p:
        for r in range(rounds):
            per_queue: dict[int, list[bytes]] = defaultdict(list)
            for k in range(KEYS):
                body = b"k%04d %d" % (k, r)
                per_queue[zlib.crc32(body.split(b" ")[0]) % QUEUES].append(body)
            for msgs in per_queue.values():
                await p.send_batch(T, msgs, selector=_queue_of)
            await asyncio.sleep(pace_s)


@pytest.mark.slow
async def test_orderly_members_join_leave_and_one_is_killed(tmp_path):
    rounds = MESSAGES // KEYS
    async with running_broker(str(tmp_path / "data")) as broker:
        addr = f"127.0.0.1:{broker.port}"
        async with Admin(addr) as admin:
            await admin.create_topic(T, QUEUES)
        outs = {f"c{i}": tmp_path / f"c{i}.log" for i in range(5)}
        members: dict[str, Member] = {}

        async def join(name: str) -> None:
            members[name] = Member(addr, name, outs[name])
            await members[name].ready()

        await asyncio.gather(join("c0"), join("c1"))
        t0 = time.monotonic()
        producer = asyncio.create_task(_produce(addr, rounds, pace_s=8.0 / rounds))

        async def at(seconds: float) -> None:
            await asyncio.sleep(max(0.0, t0 + seconds - time.monotonic()))

        await at(1.5)
        await join("c2")
        await at(3.0)
        killed_at = time.monotonic_ns()
        members["c1"].proc.kill()  # SIGKILL: no commit, no unlock, no unregister
        await asyncio.to_thread(members["c1"].proc.wait)
        await at(4.5)
        await join("c3")
        await at(6.0)
        await members.pop("c0").stop()  # graceful leave: commit, then unlock
        await at(7.5)
        await join("c4")
        await producer
        deadline = time.monotonic() + 60
        total = rounds * KEYS
        while True:
            rows = _read(outs)
            if len({(k, s) for _, _, k, s in rows}) >= total or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        for name in ("c2", "c3", "c4"):
            await members.pop(name).stop()
        rows = _read(outs)
    counts = _check(rows, rounds, "c1", killed_at)
    by_member = defaultdict(int)
    for _, name, _, _ in rows:
        by_member[name] += 1
    # the churn happened while messages flowed: every member handled some
    assert all(by_member[f"c{i}"] > 0 for i in range(5)), dict(by_member)
    assert counts["deliveries"] == total + counts["repeats"]
    print(f"orderly churn: {total} messages, {counts}, per member {dict(by_member)}")


def test_the_check_catches_reorder_loss_and_repeats_without_the_crash():
    k = b"k0001"
    ok = [(i, "a", k, s) for i, s in enumerate([0, 1, 2])]
    assert _check_one(ok, 3) is None
    # a suffix repeated after the kill, of what the killed member handled: allowed
    crash = [(1, "x", k, 0), (2, "x", k, 1), (10, "b", k, 1), (11, "b", k, 2)]
    assert _check_one(crash, 3) is None
    for bad in ([(1, "a", k, 0), (2, "a", k, 2), (3, "a", k, 1)],  # reordered
                [(1, "a", k, 0), (2, "a", k, 2)],  # lost
                [(1, "a", k, 0), (2, "a", k, 1), (3, "b", k, 1), (4, "b", k, 2)],  # repeat
                [(1, "x", k, 0), (2, "x", k, 1), (3, "b", k, 1), (4, "b", k, 2)],  # pre-kill
                ):
        assert _check_one(bad, 3) is not None, bad


def _check_one(rows, per_key: int) -> str | None:
    others = [(0, "a", b"k%04d" % i, s) for i in range(2, KEYS + 1) for s in range(per_key)]
    try:
        _check(rows + others, per_key, killed="x", killed_at=5)
    except AssertionError as exc:
        return str(exc)
    return None
