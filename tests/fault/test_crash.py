"""SIGKILL a sync-flush broker while producers send; every acknowledged send survives."""

from __future__ import annotations

import asyncio
import signal

from onceq import Admin, Message, OnceqError, Producer, PullConsumer
from tests.helpers import spawn_broker

QUEUES = 4
PRODUCERS = 4


async def _produce(addr: str, idx: int, acked: dict[str, tuple[int, int, bytes]],
                   stop: asyncio.Event) -> None:
    p = Producer(addr, retries=0, send_timeout=2.0)
    await p.start()
    i = 0
    try:
        while not stop.is_set():
            i += 1
            if i % 5 == 0:  # some batches too
                msgs = [Message(f"p{idx}-{i}-{j}".encode()) for j in range(10)]
                results = await p.send_batch("crash", msgs)
                for m, r in zip(msgs, results, strict=True):
                    acked[r.unique_key] = (r.queue_id, r.offset, m.body)
            else:
                body = f"p{idx}-{i}".encode()
                r = await p.send("crash", body)
                acked[r.unique_key] = (r.queue_id, r.offset, body)
    except OnceqError:
        pass  # the broker died under us: in-flight sends are unacknowledged
    finally:
        await p.close()


async def _read_all(addr: str) -> dict[int, list]:
    out: dict[int, list] = {}
    async with PullConsumer(addr, "check") as c:
        for q in range(QUEUES):
            msgs = []
            offset = 0
            while True:
                r = await c.pull("crash", q, offset, 500)
                if not r.messages:
                    break
                msgs.extend(r.messages)
                offset = r.next_offset
            out[q] = msgs
    return out


async def test_sigkill_sync_broker_keeps_every_acked_send(tmp_path):
    data = str(tmp_path / "data")
    args = ("--flush", "sync", "--segment-size", "65536", "--max-body", "8192")
    proc, addr = spawn_broker(data, *args)
    try:
        async with Admin(addr) as admin:
            await admin.create_topic("crash", QUEUES)
        acked: dict[str, tuple[int, int, bytes]] = {}
        stop = asyncio.Event()
        tasks = [asyncio.create_task(_produce(addr, i, acked, stop)) for i in range(PRODUCERS)]
        while len(acked) < 3000:
            await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # mid-stream: sends are in flight
        proc.wait()
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(acked) >= 3000

    proc, addr = spawn_broker(data, *args)
    try:
        stored = await _read_all(addr)
        by_key = {}
        for q, msgs in stored.items():
            # offsets continue without gaps or reuse
            assert [m.queue_offset for m in msgs] == list(range(len(msgs)))
            for m in msgs:
                assert m.unique_key not in by_key, "a message was stored twice"
                by_key[m.unique_key] = (q, m.queue_offset, m.body)
        for key, (q, off, body) in acked.items():
            assert by_key.get(key) == (q, off, body), f"acknowledged send {key} lost or moved"
        # sends after the restart continue right after the last stored offset, and a
        # producer's retry of an acknowledged send is still recognised (the dedup window
        # came back from its journal and the log after the last checkpoint)
        async with Producer(addr) as p:
            for key in list(acked)[::50]:
                q, off, body = acked[key]
                r = await p.send("crash", Message(body, unique_key=key), queue=q)
                assert r.duplicate and (r.queue_id, r.offset) == (q, off), key
            for q in range(QUEUES):
                r = await p.send("crash", b"after", queue=q)
                assert r.offset == len(stored[q])
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
