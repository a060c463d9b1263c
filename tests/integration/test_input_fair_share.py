"""The input budget is shared fairly: slow senders that fill it with partial frames do not
stall a producer whose large messages fit its share (the budget over the connections with
a partial frame); the senders that hold more than their share are the ones not read."""

from __future__ import annotations

from onceq import Admin, Producer, PullConsumer
from tests.helpers import running_broker, wait_until
from tests.integration.test_bad_input import Raw, raw_frame


async def test_slow_senders_filling_the_input_budget_do_not_stall_a_large_producer(tmp_path):
    max_body = 1024 * 1024
    max_frame = max_body + 64 * 1024
    budget = 8 * max_frame
    # a long read timeout: the stalled senders stay for the whole test (before the fair
    # share, the producer waited for it to close them, past its send timeout)
    async with running_broker(str(tmp_path / "d"),
                              store_kw={"max_body": max_body, "segment_size": 8 * max_body},
                              max_input_buffer_bytes=budget, read_timeout_s=60.0,
                              idle_timeout_s=120) as broker:
        addr = f"127.0.0.1:{broker.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        guard = broker.guard
        stalled = [await Raw.open(broker.port) for _ in range(12)]
        try:
            for r in stalled:  # each a frame of the largest size, all but its last byte
                r.writer.write(raw_frame(max_frame) + b"\0" * (max_frame - 12 - 1))
            await wait_until(lambda: guard.input_buffered > budget and len(guard.blocked) >= 6,
                             10, "the slow senders to fill the input budget")
            share = budget // 13  # twelve stalled senders and the producer
            body = b"v" * (share * 3 // 4)
            async with Producer(addr, send_timeout=5.0) as p:
                offsets = [(await p.send("T", body, queue=0)).offset for _ in range(5)]
            assert offsets == [0, 1, 2, 3, 4]
            # the stalled senders still hold their partial frames, those over their share
            # are not read: the budget stays bounded
            assert guard.input_buffered <= 2 * budget + 12 * 256 * 1024
            assert guard.partial == sum(1 for c in broker.connections if c.buffered) == 12
            async with PullConsumer(addr, "g") as c:
                got = await c.pull("T", 0, 0, 5)
            assert [m.body for m in got.messages] == [body] * 5
        finally:
            for r in stalled:
                r.writer.close()
