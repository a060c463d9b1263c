"""The writers' sequence table survives a SIGKILL of the broker: rebuilt from its snapshot
and the sequenced messages stored after it (or from the whole log without a snapshot)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from onceq import Admin
from onceq.client.sequenced import SequencedWriter
from tests.helpers import spawn_broker, wait_until
from tests.integration.test_sequenced_send import bodies

T = "seqcrash"


async def send_all(addr: str, epoch: int, counts: dict[int, int]) -> SequencedWriter:
    w = SequencedWriter(addr, "query-1/0", epoch)
    try:
        for q, n in counts.items():
            for seq in range(0, n, 40):
                k = min(40, n - seq)
                await w.submit(T, q, seq, [(f"e{epoch}q{q}s{s}".encode(), "", "", "", None)
                                           for s in range(seq, seq + k)])
        await w.flush()
    finally:
        await w.close()
    return w


def kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def test_sequences_survive_sigkill(tmp_path):
    data = str(tmp_path / "data")
    args = ("--dedup-window", "0.2")  # the window is no help here
    proc, addr = spawn_broker(data, *args)
    try:
        async def phase1() -> None:
            async with Admin(addr) as a:
                await a.create_topic(T, 3)
            await send_all(addr, 0, {0: 200, 1: 120})
        asyncio.run(phase1())
        kill(proc)
        # no snapshot at all: the table comes from the whole log
        if os.path.exists(os.path.join(data, "writers.json")):
            os.unlink(os.path.join(data, "writers.json"))
        proc, addr = spawn_broker(data, *args)

        async def phase2() -> None:
            again = await send_all(addr, 0, {0: 200, 1: 150})
            assert (again.stored, again.duplicates) == (30, 320)
            # a snapshot is written (every second when changed; the old one was removed)
            await wait_until(lambda: os.path.exists(os.path.join(data, "writers.json")), 10,
                             "the writers snapshot")
            await send_all(addr, 1, {0: 80, 2: 40})  # stored after the snapshot
        asyncio.run(phase2())
        stored_at = time.monotonic()  # the last message stored (by the broker's clock: before)
        assert os.path.exists(os.path.join(data, "writers.json"))
        kill(proc)
        proc, addr = spawn_broker(data, *args)

        async def phase3() -> None:
            old = await send_all(addr, 0, {0: 200, 1: 150})  # an older epoch: all there
            assert (old.stored, old.duplicates) == (0, 350)
            replay = await send_all(addr, 1, {0: 100, 1: 10, 2: 40})
            assert (replay.stored, replay.duplicates) == (30, 120)
            got = await bodies(addr, T, 3)
            assert len(got) == len(set(got)) == 200 + 150 + 100 + 10 + 40
        # beyond the dedup window (of the broker process's own clock) since the last message
        # stored: the kill and the restart have taken most or all of it already
        time.sleep(max(0.0, 0.3 - (time.monotonic() - stored_at)))
        asyncio.run(phase3())
    finally:
        proc.kill()
        proc.wait(10)
