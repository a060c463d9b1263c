"""10,000 queues under ``ulimit -n 1024``: index files go through a bounded cache of open
files, so produce, pull, a SIGKILL and a restart all work under the limit."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from onceq import Admin, Producer, PullConsumer
from onceq.protocol.codes import PullStatus
from tests.helpers import spawn_broker

TOPICS = 10
QUEUES = 1000  # 10 x 1000 = 10,000 queues
LIMIT = 1024


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _pull_every_queue(addr: str, expect: dict[tuple[str, int], bytes]) -> list:
    wrong = []
    async with PullConsumer(addr, "fdcheck") as c:
        keys = list(expect)
        for i in range(0, len(keys), 200):
            chunk = keys[i:i + 200]
            results = await asyncio.gather(*(c.pull(t, q, 0, 4) for t, q in chunk))
            for (t, q), r in zip(chunk, results, strict=True):
                if r.status != PullStatus.FOUND or [m.body for m in r.messages] != [expect[t, q]]:
                    wrong.append((t, q, r.status, [m.body for m in r.messages]))
    return wrong


@pytest.mark.slow
async def test_ten_thousand_queues_under_an_fd_limit_of_1024(tmp_path):
    data = str(tmp_path / "data")
    proc, addr = spawn_broker(data, fd_limit=LIMIT)
    try:
        expect: dict[tuple[str, int], bytes] = {}
        async with Admin(addr) as admin:
            for t in range(TOPICS):
                await admin.create_topic(f"fd{t}", QUEUES)
        async with Producer(addr) as p:
            for t in range(TOPICS):
                sends = []
                for q in range(QUEUES):
                    body = f"fd{t}/{q}".encode()
                    expect[f"fd{t}", q] = body
                    sends.append(p.send(f"fd{t}", body, queue=q))
                results = await asyncio.gather(*sends)
                assert [r.offset for r in results] == [0] * QUEUES
        fds_loaded = _fds(proc.pid)
        assert await _pull_every_queue(addr, expect) == []
        assert fds_loaded < LIMIT // 2, fds_loaded
        proc.send_signal(signal.SIGKILL)  # no checkpoint of the last writes, no close
        proc.wait()
        proc, addr = spawn_broker(data, fd_limit=LIMIT)
        assert await _pull_every_queue(addr, expect) == []
        async with Producer(addr) as p:  # and the queues go on after the restart
            r = await p.send("fd9", b"after", queue=999)
            assert r.offset == 1
        assert _fds(proc.pid) < LIMIT // 2
    finally:
        proc.kill()
        proc.wait()


async def test_more_segments_than_the_fd_limit(tmp_path):
    """1,200 commit-log segments of 64 KiB under ``ulimit -n 1024``: older segments are
    opened on demand, so writing, reading from the start, a SIGKILL and a restart work."""
    data = str(tmp_path / "data")
    args = ("--segment-size", "65536", "--max-body", "8192")
    proc, addr = spawn_broker(data, *args, fd_limit=LIMIT)
    body = b"s" * 4000
    try:
        async with Admin(addr) as admin:
            await admin.create_topic("segs", 1)
        async with Producer(addr) as p:
            for _ in range(19_200 // 16):
                await p.send_batch("segs", [body] * 16, queue=0)
        segments = len(os.listdir(os.path.join(data, "commitlog")))
        assert segments > LIMIT + 100, segments
        assert _fds(proc.pid) < LIMIT // 2

        async def read_all() -> int:
            n = 0
            async with PullConsumer(addr, "segcheck") as c:
                offset = 0
                while True:
                    r = await c.pull("segs", 0, offset, 256)
                    if not r.messages:
                        return n
                    assert all(m.body == body for m in r.messages)
                    assert r.messages[0].queue_offset == offset
                    n += len(r.messages)
                    offset = r.next_offset

        assert await read_all() == 19_200
        assert _fds(proc.pid) < LIMIT // 2
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc, addr = spawn_broker(data, *args, fd_limit=LIMIT)
        assert await read_all() == 19_200
        assert _fds(proc.pid) < LIMIT // 2
    finally:
        proc.kill()
        proc.wait()
