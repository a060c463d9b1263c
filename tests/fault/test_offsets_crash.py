"""SIGKILL a broker right after offset commits were acknowledged: none is lost."""

from __future__ import annotations

import asyncio
import signal

import pytest

from onceq import Admin, OnceqError, Producer, PullConsumer
from tests.helpers import spawn_broker

QUEUES = 4
GROUPS = 3


async def _commit_loop(addr: str, group: str, acked: dict[tuple[str, int], int],
                       stop: asyncio.Event) -> None:
    async with PullConsumer(addr, group) as c:
        offset = 0
        try:
            while not stop.is_set():
                offset += 1
                q = offset % QUEUES
                await c.commit_offset("oc", q, offset)
                acked[(group, q)] = offset  # acknowledged: must survive
        except OnceqError:
            pass  # the broker died under us: the commit in flight is unacknowledged


@pytest.mark.parametrize("flush", ["async", "sync"])
async def test_sigkill_keeps_every_acknowledged_commit(tmp_path, flush):
    data = str(tmp_path / "data")
    args = ("--flush", flush)
    proc, addr = spawn_broker(data, *args)
    try:
        async with Admin(addr) as admin:
            await admin.create_topic("oc", QUEUES)
        async with Producer(addr) as p:  # every committed offset lies within its queue
            for q in range(QUEUES):
                await p.send_batch("oc", [b"x"] * 1000, queue=q)
        acked: dict[tuple[str, int], int] = {}
        stop = asyncio.Event()
        tasks = [asyncio.create_task(_commit_loop(addr, f"g{i}", acked, stop))
                 for i in range(GROUPS)]
        while sum(acked.values()) < 3000:
            await asyncio.sleep(0.01)
        proc.send_signal(signal.SIGKILL)  # well inside the 1 s between offsets snapshots
        proc.wait()
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(acked) == GROUPS * QUEUES

    proc, addr = spawn_broker(data, *args)
    try:
        async with Admin(addr) as admin:
            for (group, q), offset in sorted(acked.items()):
                got = await admin.group_offset(group, "oc", q)
                # the unacknowledged commit in flight may have landed (one step later)
                assert got in (offset, offset + QUEUES), (group, q, offset, got)
            assert [t["topic"] for t in await admin.list_topics()] == ["oc"]
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
