"""The concurrent consume service without a broker: its workers, the concurrency bound,
drain on revoke, and the threads of a plain listener."""

from __future__ import annotations

import asyncio
import threading

import pytest

from onceq.client.allocation import MessageQueue
from onceq.client.consume import ConsumeContext, ConsumeStatus
from onceq.client.consume_concurrent import ConcurrentConsumeService
from onceq.client.process_queue import ProcessQueue
from onceq.client.push import PushConsumer
from onceq.client.runner import ListenerRunner, ListenerThreads
from onceq.log.record import MessageExt

MQ = MessageQueue("T", 0)


def _msgs(n: int, start: int = 0) -> list[MessageExt]:
    return [MessageExt("T", 0, i, b"x", f"k{i}") for i in range(start, start + n)]


class Gate:
    """An async listener that records its calls and holds each until ``open``."""

    def __init__(self) -> None:
        self.running = 0
        self.most = 0
        self.started: list[int] = []
        self.opened = asyncio.Event()
        self.changed = asyncio.Event()

    async def __call__(self, msgs: list[MessageExt], ctx: ConsumeContext) -> None:
        self.started.append(msgs[0].queue_offset)
        self.running += 1
        self.most = max(self.most, self.running)
        self.changed.set()
        try:
            await self.opened.wait()
        finally:
            self.running -= 1
            self.changed.set()

    async def until(self, cond) -> None:
        while not cond():
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 5)


def _service(listener, **settings) -> tuple[PushConsumer, ConcurrentConsumeService,
                                             ProcessQueue]:
    c = PushConsumer("127.0.0.1:1", "g", listener, **settings)
    s = ConcurrentConsumeService(c.coordinator, c.config, c.owned, c.offsets,
                                 ListenerRunner(listener, c.config.consume_timeout_s))
    pq = ProcessQueue(MQ, 0, c.clock())
    c.owned.take(pq)
    s.start()
    return c, s, pq


def _feed(s: ConcurrentConsumeService, pq: ProcessQueue, n: int) -> None:
    msgs = _msgs(n)
    pq.add(msgs)
    pq.next_offset = n
    s.dispatch(pq, msgs)


async def test_at_most_concurrency_calls_run_at_once_and_all_complete():
    gate = Gate()
    c, s, pq = _service(gate, concurrency=3)
    _feed(s, pq, 10)
    await gate.until(lambda: gate.running == 3)
    for _ in range(20):  # loop passes: nothing else starts while three run
        await asyncio.sleep(0)
    assert gate.running == 3 and gate.started == [0, 1, 2]
    assert pq.commit_offset == 0  # the lowest in flight holds the commit back
    gate.opened.set()
    await gate.until(lambda: len(pq) == 0)
    assert gate.most == 3 and sorted(gate.started) == list(range(10))
    assert pq.commit_offset == 10 and c.stats["consumed"] == 10
    await s.stop()


async def test_drain_waits_for_running_calls_and_skips_batches_not_started():
    gate = Gate()
    c, s, pq = _service(gate, concurrency=2, drain_timeout_s=5.0)
    _feed(s, pq, 6)
    await gate.until(lambda: gate.running == 2)
    c.owned.revoke(pq)
    drain = asyncio.ensure_future(s.drain(pq))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not drain.done()  # two calls still run
    gate.opened.set()
    await asyncio.wait_for(drain, 5)
    assert gate.running == 0 and sorted(gate.started) == [0, 1]
    for _ in range(20):  # the workers reach the other batches: dropped, never run
        await asyncio.sleep(0)
    assert sorted(gate.started) == [0, 1]
    assert pq.commit_offset == 2  # the two finished; the rest is the next owner's
    await s.stop()


async def test_a_cancelled_drain_done_again_waits_for_the_same_calls():
    gate = Gate()
    c, s, pq = _service(gate, concurrency=2, drain_timeout_s=5.0)
    _feed(s, pq, 2)
    await gate.until(lambda: gate.running == 2)
    c.owned.revoke(pq)
    first = asyncio.ensure_future(s.drain(pq))
    await asyncio.sleep(0)
    first.cancel()
    again = asyncio.ensure_future(s.drain(pq))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not again.done()
    gate.opened.set()
    await asyncio.wait_for(again, 5)
    assert gate.running == 0 and pq.commit_offset == 2
    await s.stop()


async def test_drain_gives_up_after_its_timeout_and_a_late_result_is_dropped(caplog):
    gate = Gate()
    c, s, pq = _service(gate, concurrency=2, drain_timeout_s=0.05)
    _feed(s, pq, 1)
    await gate.until(lambda: gate.running == 1)
    c.owned.revoke(pq)
    await asyncio.wait_for(s.drain(pq), 5)
    assert "still running after the drain timeout" in caplog.text
    c.owned.forget(pq)  # released: the next owner reads the message again
    gate.opened.set()
    await gate.until(lambda: gate.running == 0)
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(pq) == 1 and c.stats["consumed"] == 0
    assert "after its queue was released" in caplog.text
    await s.stop()


async def test_partial_success_retries_the_messages_after_the_ack_index():
    seen: list[list[int]] = []

    async def listener(msgs, ctx):
        seen.append([m.queue_offset for m in msgs])
        ctx.ack_index = 1
        return ConsumeStatus.SUCCESS

    # broadcasting: failed messages are logged and skipped (no retry topic, no broker)
    c, s, pq = _service(listener, batch_size=4, concurrency=1, model="BROADCASTING")
    _feed(s, pq, 4)
    for _ in range(50):
        await asyncio.sleep(0)
        if not len(pq):
            break
    assert seen == [[0, 1, 2, 3]]
    assert c.stats["consumed"] == 2 and c.stats["failed"] == 2 and len(pq) == 0
    await s.stop()


async def test_a_call_over_the_consume_timeout_fails_and_its_worker_goes_on(caplog):
    calls: list[int] = []
    cancelled: list[int] = []

    async def listener(msgs, ctx):
        offset = msgs[0].queue_offset
        calls.append(offset)
        if offset in (0, 2):  # over time; 2 swallows the cancel: its result stands
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled.append(offset)
                if offset == 0:
                    raise

    # broadcasting: a failed message is logged and skipped (no retry topic, no broker)
    c, s, pq = _service(listener, concurrency=1, consume_timeout_s=0.05,
                        model="BROADCASTING")
    _feed(s, pq, 4)
    async with asyncio.timeout(5):
        while len(pq):
            await asyncio.sleep(0.01)
    assert calls == [0, 1, 2, 3] and cancelled == [0, 2]
    assert c.stats["failed"] == 1 and c.stats["consumed"] == 3
    assert caplog.text.count("exceeded the consume timeout") == 1
    await s.stop()


async def test_plain_listener_runs_on_threads_within_the_concurrency_bound():
    lock = threading.Lock()
    running = [0, 0]  # now, most
    release = threading.Event()
    calls: list[int] = []

    def listener(msgs, ctx):
        with lock:
            running[0] += 1
            running[1] = max(running)
            calls.append(msgs[0].queue_offset)
        release.wait(5)
        with lock:
            running[0] -= 1

    c, s, pq = _service(listener, concurrency=4)
    s.runner.threads = ListenerThreads(4, asyncio.get_running_loop())
    _feed(s, pq, 40)
    while len(calls) < 4:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)
    assert running[0] == 4 and len(calls) == 4
    release.set()
    while len(pq):
        await asyncio.sleep(0.005)
    assert running[1] == 4 and sorted(calls) == list(range(40))
    assert c.stats["consumed"] == 40 and pq.commit_offset == 40
    s.runner.shutdown()
    await s.stop()


async def test_listener_threads_hand_back_results_exceptions_and_drop_late_ones():
    threads = ListenerThreads(2, asyncio.get_running_loop())
    results = await asyncio.gather(*(threads.submit(lambda i=i: i * i) for i in range(100)))
    assert results == [i * i for i in range(100)]
    with pytest.raises(ValueError, match="bad"):
        await threads.submit(_raise, ValueError("bad"))
    slow = threading.Event()
    fut = threads.submit(slow.wait, 5)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):  # the consume timeout gives the call up
            await fut
    slow.set()
    assert await threads.submit(lambda: "after") == "after"  # the late result is dropped
    threads.shutdown()


async def test_listener_threads_after_shutdown_run_no_more_calls():
    threads = ListenerThreads(1, asyncio.get_running_loop())
    began, hold = threading.Event(), threading.Event()
    ran: list[str] = []

    def running() -> bool:
        began.set()
        return hold.wait(5)

    first = threads.submit(running)
    queued = threads.submit(ran.append, "queued")
    await asyncio.to_thread(began.wait, 5)
    threads.shutdown()
    hold.set()
    assert await first is True  # a running call finishes
    with pytest.raises(RuntimeError, match="shut down"):
        await queued
    assert ran == []


def _raise(exc: Exception) -> None:
    raise exc
