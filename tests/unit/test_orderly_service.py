"""The orderly consume service's pure decisions, with the suite's fake clock."""

from __future__ import annotations

import asyncio

from onceq.client.allocation import MessageQueue
from onceq.client.consume import ConsumeStatus, is_orderly, orderly
from onceq.client.consume_orderly import OrderlyConsumeService, suspend_seconds
from onceq.client.process_queue import ProcessQueue
from onceq.client.push import PushConsumer, wire_service
from onceq.client.runner import ListenerRunner
from onceq.log.record import MessageExt
from tests.clock import FakeClock

MQ = MessageQueue("T", 0)


def _service(c: PushConsumer) -> OrderlyConsumeService:
    s = wire_service(c, ListenerRunner(c.listener, c.config.consume_timeout_s))
    assert isinstance(s, OrderlyConsumeService)
    return s


def test_a_queue_stops_when_its_lock_is_older_than_the_max_age():
    clock = FakeClock()
    c = PushConsumer("127.0.0.1:1", "g", lambda m, c: None, clock=clock, orderly=True)
    s = _service(c)
    assert not s.locked(MQ)  # never locked
    s._locked_at[MQ] = clock()
    clock.advance(30.0)
    assert s.locked(MQ)
    clock.advance(0.001)
    assert not s.locked(MQ)
    s._locked_at[MQ] = clock()  # relocked (a renewal)
    assert s.locked(MQ)


def test_broadcasting_takes_no_lock():
    c = PushConsumer("127.0.0.1:1", "g", lambda m, c: None, model="BROADCASTING",
                     orderly=True)
    assert _service(c).locked(MQ)


def test_suspend_time_is_bounded():
    assert suspend_seconds(0, 1.0) == 1.0
    assert suspend_seconds(500, 1.0) == 0.5
    assert suspend_seconds(1, 1.0) == 0.01
    assert suspend_seconds(60_000, 1.0) == 30.0


def test_listener_kind_or_setting_chooses_orderly():
    def plain(msgs, ctx):
        return ConsumeStatus.SUCCESS

    assert not PushConsumer("127.0.0.1:1", "g", plain).orderly
    assert PushConsumer("127.0.0.1:1", "g", plain, orderly=True).orderly
    marked = orderly(lambda msgs, ctx: None)
    assert is_orderly(marked) and PushConsumer("127.0.0.1:1", "g", marked).orderly


class _EndsThenArrives(ProcessQueue):
    """When the run finds the queue empty, a message arrives in the same loop pass (after
    the run's last step, before anything the run's end schedules)."""

    def __init__(self, *a, arrive) -> None:
        super().__init__(*a)
        self.arrive = arrive

    def head(self, n):
        out = super().head(n)
        if not out and self.arrive is not None:
            asyncio.get_running_loop().call_soon(self.arrive)
            self.arrive = None
        return out


def _msg(offset: int) -> MessageExt:
    return MessageExt("T", 0, offset, b"x", f"k{offset}")


def _locked_queue(listener, **options) -> tuple[PushConsumer, OrderlyConsumeService,
                                                 ProcessQueue]:
    """An orderly consumer (never started) whose service holds MQ's lock, and a process
    queue of MQ it owns (call inside a running loop)."""
    c = PushConsumer("127.0.0.1:1", "g", listener, orderly=True, **options)
    s = _service(c)
    s._locked_at[MQ] = c.clock()
    return c, s, _take(c)


def _take(c: PushConsumer) -> ProcessQueue:
    pq = ProcessQueue(MQ, 0, c.clock())
    c.owned.take(pq)
    return pq


def test_a_message_arriving_as_the_run_ends_starts_a_new_run_at_once():
    handled: list[int] = []

    async def listener(msgs, ctx):
        handled.extend(m.queue_offset for m in msgs)

    async def main():
        c = PushConsumer("127.0.0.1:1", "g", listener, orderly=True)
        s = _service(c)

        def arrive():
            pq.add([_msg(1)])
            s.dispatch(pq, [_msg(1)])

        pq = _EndsThenArrives(MQ, 0, c.clock(), arrive=arrive)
        c.owned.take(pq)
        s._locked_at[MQ] = c.clock()
        pq.add([_msg(0)])
        s.dispatch(pq, [_msg(0)])
        for _ in range(100):  # loop passes, far less than the next lock renewal
            await asyncio.sleep(0)
        return pq

    pq = asyncio.run(main())
    assert handled == [0, 1] and len(pq) == 0


def test_after_an_offset_reset_the_new_run_waits_for_the_old_ones_listener_call():
    """A forced reset drops the queue's process queue mid-call and takes the queue again
    at once: the new run must not call the listener while the old call still runs."""
    events: list[tuple[str, int]] = []
    release = asyncio.Event()

    async def listener(msgs, ctx):
        events.append(("start", ctx.attempt))
        if len(events) == 1:
            await release.wait()  # the old run's call, still running at the reset
        events.append(("end", ctx.attempt))

    async def main():
        c, s, old = _locked_queue(listener)
        old.add([_msg(0)])
        s.dispatch(old, [_msg(0)])
        for _ in range(5):
            await asyncio.sleep(0)
        assert events == [("start", 1)]
        c.owned.drop(old)  # the reset (Coordinator._on_reset, then _retake)
        c.owned.forget(old)
        s.forget(old)
        new = _take(c)
        new.add([_msg(0)])
        s.dispatch(new, [_msg(0)])
        for _ in range(20):
            await asyncio.sleep(0)
        assert events == [("start", 1)]  # the new run waits
        release.set()
        for _ in range(50):
            await asyncio.sleep(0)
        return new

    new = asyncio.run(main())
    assert events == [("start", 1), ("end", 1), ("start", 1), ("end", 1)]
    assert len(new) == 0


def test_messages_the_listener_dead_letters_go_to_the_dlq_and_the_queue_moves_on(
        monkeypatch):
    """The idempotency layer answers SUCCESS with ``ack_index`` before a message it cannot
    take (no key, another payload) and delay level -1: that message goes to the DLQ with
    its reason, instead of being retried in place for ever."""
    sent: list[tuple[int, int, str | None]] = []

    async def fake_send_back(pq, m, delay_level, dlq_reason=None):
        sent.append((m.queue_offset, delay_level, dlq_reason))

    calls: list[list[int]] = []

    async def listener(msgs, ctx):
        calls.append([m.queue_offset for m in msgs])
        if msgs[0].queue_offset == 1:
            ctx.ack_index, ctx.delay_level = -1, -1
            ctx.dlq_reasons[0] = "idempotency: no dedup key"
        return ConsumeStatus.SUCCESS

    async def main():
        c, s, pq = _locked_queue(listener)
        monkeypatch.setattr(s, "send_back", fake_send_back)
        batch = [_msg(i) for i in range(3)]
        pq.add(batch)
        s.dispatch(pq, batch)
        for _ in range(50):
            await asyncio.sleep(0)
        return c, pq

    c, pq = asyncio.run(main())
    assert calls == [[0], [1], [2]]  # each message once: 1 was not retried in place
    assert sent == [(1, -1, "idempotency: no dedup key")]
    assert len(pq) == 0 and c.stats["dlq"] == 1 and c.stats["consumed"] == 2


def test_a_lost_connection_stops_consumption_until_the_locks_are_renewed():
    """The broker frees a disconnected member's locks at once: the member stops taking
    new batches then, not 30 s later when its locks would be too old."""
    class Conn:
        def __init__(self) -> None:
            self.lost = asyncio.get_running_loop().create_future()

    async def main():
        c = PushConsumer("127.0.0.1:1", "g", lambda m, ctx: None, orderly=True)
        s = _service(c)

        async def renew(conn=None):
            s._locked_at[MQ] = c.clock()  # granted again
        s.renew = renew
        old = Conn()
        c._conn = old
        await s.reconnected(old)
        assert s.locked(MQ)
        old.lost.set_result(None)
        await asyncio.sleep(0)
        assert not s.locked(MQ)  # stopped at once
        new = Conn()
        c._conn = new
        await s.reconnected(new)
        assert s.locked(MQ)
        other = Conn()  # an old connection that closes late changes nothing
        await s.reconnected(other)
        other.lost.set_result(None)
        await asyncio.sleep(0)
        assert s.locked(MQ)

    asyncio.run(main())


def test_a_plain_listener_over_the_consume_timeout_is_waited_for_before_the_retry(caplog):
    """A thread cannot be stopped: after the consume timeout, the orderly service waits
    for the call to end before it tries the batch again (never two calls at once)."""
    import threading

    from onceq.client.runner import ListenerThreads

    running = 0
    most = 0
    calls = 0
    lock = threading.Lock()
    first_may_end = threading.Event()

    def listener(msgs, ctx):
        nonlocal running, most, calls
        with lock:
            running += 1
            calls += 1
            most = max(most, running)
            first = calls == 1
        if first:
            first_may_end.wait(5)  # over the timeout
        with lock:
            running -= 1
        return ConsumeStatus.SUCCESS

    async def main():
        loop = asyncio.get_running_loop()
        _c, s, pq = _locked_queue(listener, consume_timeout_s=0.05, suspend_s=0.01)
        s.runner.threads = ListenerThreads(4, loop)
        pq.add([_msg(0)])
        s.dispatch(pq, [_msg(0)])
        for _ in range(250):  # the first call starts on a thread
            if calls:
                break
            await asyncio.sleep(0.02)
        # the timeout has passed (the runner says so) ...
        for _ in range(250):
            if "exceeded the consume timeout" in caplog.text:
                break
            await asyncio.sleep(0.02)
        assert "exceeded the consume timeout" in caplog.text
        # ... and the retry waits: a retry not waiting would come one suspend (10 ms) later
        await asyncio.sleep(0.1)
        assert calls == 1
        first_may_end.set()
        for _ in range(100):
            if len(pq) == 0:
                break
            await asyncio.sleep(0.02)
        s.runner.shutdown()
        return pq

    pq = asyncio.run(main())
    assert len(pq) == 0 and calls == 2 and most == 1
