"""What a listener is given and returns, and the consume-service interface.

A push consumer hands the messages it pulls to one consume service (RocketMQ's
``ConsumeMessageConcurrentlyService`` / ``ConsumeMessageOrderlyService`` split):
:class:`~onceq.client.consume_concurrent.ConcurrentConsumeService` runs listener calls in
parallel and sends failures to the retry topic; :class:`~onceq.client.consume_orderly.
OrderlyConsumeService` runs one batch of a queue at a time, in offset order, under a broker
queue lock. The service is chosen by the listener kind (:func:`orderly`) or the
``orderly`` setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import queue
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

from ..log.record import MessageExt
from .allocation import MessageQueue
from .connection import BrokerConnection
from .process_queue import ProcessQueue

if TYPE_CHECKING:
    from .push import PushConsumer

log = logging.getLogger("onceq.consumer")


class ConsumeStatus(StrEnum):
    SUCCESS = "SUCCESS"
    RECONSUME_LATER = "RECONSUME_LATER"  # concurrent: retry later through the retry topic
    SUSPEND = "SUSPEND"  # orderly: pause the queue, then retry the same messages in place


@dataclass(slots=True)
class ConsumeContext:
    """Passed to the listener with each batch.

    ``ack_index``: with SUCCESS, messages after this index are retried (partial success);
    the default covers the whole batch (concurrent mode). ``delay_level``: 0 lets the broker
    choose (3 + reconsume count), -1 sends the retried messages straight to the group's DLQ;
    a listener may set another level for its retries. ``group``: the consumer group.
    ``suspend_ms`` (orderly mode): how long to pause the queue after SUSPEND (0: the
    consumer's ``suspend_s`` setting; bounded to 10 ms..30 s). ``attempt`` (orderly mode):
    1 on the first call with these messages, 2 on the first retry in place, ...
    ``dlq_reasons``: batch index -> why that message is given up; the broker stores it in
    the message's ``DLQ_REASON`` property when the retry takes it to the DLQ.
    """

    queue: MessageQueue
    ack_index: int
    delay_level: int = 0
    group: str = ""
    suspend_ms: int = 0
    attempt: int = 1
    dlq_reasons: dict[int, str] = field(default_factory=dict)

    def acked(self, size: int) -> int:
        """How many of a batch of ``size`` messages a SUCCESS acknowledges: those up to
        ``ack_index``, clamped to the batch (a negative index acknowledges none, never
        slices from the end)."""
        return min(max(self.ack_index, -1), size - 1) + 1


Listener = Callable[[list[MessageExt], ConsumeContext],
                    Awaitable[ConsumeStatus | None] | ConsumeStatus | None]
L = TypeVar("L")


def orderly(listener: L) -> L:
    """Mark ``listener`` as an orderly listener: a push consumer given it consumes each
    queue strictly in order (one batch at a time, under the broker's queue lock)."""
    try:
        listener.onceq_orderly = True  # type: ignore[attr-defined]
    except AttributeError:  # e.g. a bound method
        raise TypeError(f"cannot mark {listener!r} as orderly: pass orderly=True to the "
                        "consumer instead") from None
    return listener


def is_orderly(listener: Any) -> bool:
    return getattr(listener, "onceq_orderly", False) is True


class ListenerThreads:
    """``n`` threads running the calls of a plain (not async) listener.

    Finished calls come back to the event loop in bulk: the first result of a burst
    schedules one wake-up of the loop, which settles every call finished by then (an
    executor wakes the loop once per call, the main cost at listener batch 1). Daemon
    threads: a consumer never shut down does not keep the process alive.
    """

    def __init__(self, n: int, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue[tuple[asyncio.Future[Any], Callable[..., Any],
                                            tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._done: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"onceq-consume-{i}",
                                          daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Run ``fn(*args)`` on a thread; its result or exception, on the loop."""
        fut = self._loop.create_future()
        self._jobs.put((fut, fn, args))
        return fut

    def shutdown(self) -> None:
        """Calls not started fail; running ones finish (their results are dropped)."""
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn, args = job
            result = exc = None
            if self._closed:
                exc = RuntimeError("the consumer was shut down")
            else:
                try:
                    result = fn(*args)
                except BaseException as e:  # handed to the caller, like an executor
                    exc = e
            with self._lock:
                self._done.append((fut, result, exc))
                first = len(self._done) == 1
            if first:
                # a closed loop: nobody waits any more
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._settle)

    def _settle(self) -> None:
        with self._lock:
            done, self._done = self._done, []
        for fut, result, exc in done:
            if fut.done():  # given up (the consume timeout)
                continue
            if exc is None:
                fut.set_result(result)
            else:
                fut.set_exception(exc)


class ConsumeService:
    """Runs the listener on what the pull loops fetched. One instance per consumer."""

    failure = ConsumeStatus.RECONSUME_LATER  # what an exception or a timeout counts as

    def __init__(self, consumer: PushConsumer) -> None:
        self.consumer = consumer

    def start(self) -> None:
        """Start background work (the consumer is running)."""

    async def stop(self) -> None:
        """Stop background work (after every queue was released)."""

    async def acquire(self, mqs: list[MessageQueue]) -> set[MessageQueue]:
        """Before newly assigned queues are taken: those that may be taken now (the others
        are left for a later rebalance)."""
        return set(mqs)

    def may_pull(self, pq: ProcessQueue) -> bool:
        """Whether the pull loop of ``pq`` may pull now (else it waits a moment)."""
        return True

    def dispatch(self, pq: ProcessQueue, msgs: list[MessageExt]) -> None:
        """Messages just added to ``pq``: have them consumed."""
        raise NotImplementedError

    async def drain(self, pq: ProcessQueue) -> None:
        """``pq`` is revoked: wait (bounded by the drain timeout) for its listener calls."""
        raise NotImplementedError

    def forget(self, pq: ProcessQueue) -> None:
        """``pq`` was dropped without a drain (an offset reset): results are thrown away."""

    async def reconnected(self, conn: BrokerConnection) -> None:
        """A new broker connection, before other requests use it."""

    async def release(self, pq: ProcessQueue) -> None:
        """Last step of a revoke: commit the offset of ``pq``, then give the queue up."""
        await self.consumer.offsets.release(pq)

    # ---------------------------------------------------------------- shared
    async def call_listener(self, batch: list[MessageExt], ctx: ConsumeContext
                            ) -> ConsumeStatus:
        """Run the listener under the consume timeout; an exception, a timeout or a bad
        result is a failure."""
        try:
            async with asyncio.timeout(self.consumer.config.consume_timeout_s):
                return await self.run_listener(batch, ctx)
        except TimeoutError:
            return self.timed_out(ctx)

    async def run_listener(self, batch: list[MessageExt], ctx: ConsumeContext
                           ) -> ConsumeStatus:
        """Run the listener without a timeout; an exception or a bad result is a failure."""
        c = self.consumer
        try:
            listener = c.listener
            if c._threads is None:
                result = await listener(batch, ctx)  # type: ignore[misc]
            else:
                result = await c._threads.submit(listener, batch, ctx)
            return await self.status_of(result)
        except Exception:
            return self.listener_failed(ctx)

    @staticmethod
    async def status_of(result: Any) -> ConsumeStatus:
        """The status a listener's result stands for (raises for a result that is none)."""
        if result is None:
            return ConsumeStatus.SUCCESS
        if inspect.isawaitable(result):  # e.g. an object with an async __call__
            result = await result
        return ConsumeStatus.SUCCESS if result is None else ConsumeStatus(result)

    def listener_failed(self, ctx: ConsumeContext) -> ConsumeStatus:
        """In an ``except`` block: the listener raised. Includes a result that is no
        ConsumeStatus: it must not leave the batch in flight forever, holding the queue's
        commit offset back."""
        log.exception("listener failed on %s; retrying the batch", ctx.queue)
        return self.failure

    def timed_out(self, ctx: ConsumeContext) -> ConsumeStatus:
        log.warning("listener exceeded the consume timeout of %.0fs on %s; retrying",
                    self.consumer.config.consume_timeout_s, ctx.queue)
        return self.failure
