"""A damaged record seen through the broker: the DAMAGED pull status, the broker status
request and CLI, and a push consumer that skips the damaged offset and consumes the rest."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from onceq import Admin, Producer, PullConsumer, PushConsumer
from onceq.log.segment import FILE_HEADER_SIZE
from onceq.protocol.codes import PullStatus
from onceq.storage.store import MessageStore
from tests.helpers import running_broker, small_store


async def test_damaged_offset_is_skipped_and_reported(tmp_path):
    root = str(tmp_path)
    async with running_broker(root) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        async with Producer(addr) as p:
            sent = [(await p.send("T", f"m{i}".encode() * 20)).offset for i in range(50)]
    assert sent == list(range(50))
    # damage the record of offset 20 (below the checkpoint: found when it is read)
    store = MessageStore(small_store(root))
    store.open()
    pos = store.queues["T", 0].entry(20)[0]
    seg = store.log._find(pos)
    store.close()
    with open(seg.path, "r+b") as f:
        f.seek(FILE_HEADER_SIZE + pos - seg.base + 60)
        byte = f.read(1)[0]
        f.seek(FILE_HEADER_SIZE + pos - seg.base + 60)
        f.write(bytes([byte ^ 0xFF]))

    async with running_broker(root) as b:
        addr = f"127.0.0.1:{b.port}"
        async with PullConsumer(addr, "g") as c:
            r = await c.pull("T", 0, 18, 10)
            assert r.status == PullStatus.FOUND and [m.queue_offset for m in r.messages] == [
                18, 19]
            r = await c.pull("T", 0, 20, 10)
            assert r.status == PullStatus.DAMAGED and r.next_offset == 21 and not r.messages
        async with Admin(addr) as admin:
            st = await admin.broker_status()
        assert st["damaged"]["queues"] == {"T": {"0": [[20, 21]]}}
        assert st["log_end"] > st["log_start"] == 0
        out = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "onceq.cli.main", "broker", "status",
                             "-b", addr, "--json"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["damaged"]["queues"] == {"T": {"0": [[20, 21]]}}

        seen: list[int] = []
        done = asyncio.Event()

        async def listener(batch, ctx):
            seen.extend(m.queue_offset for m in batch)
            if len(seen) >= 49:
                done.set()

        pc = PushConsumer(addr, "pg", listener, consume_from="FIRST", rebalance_interval_s=1.0)
        pc.subscribe("T", "*")
        await pc.start()
        try:
            await asyncio.wait_for(done.wait(), 15)
        finally:
            await pc.shutdown()
        assert sorted(seen) == [o for o in range(50) if o != 20]
        async with Admin(addr) as admin:
            assert await admin.group_offset("pg", "T", 0) == 50
    assert os.path.exists(os.path.join(root, "damaged.json"))
