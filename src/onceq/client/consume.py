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
import inspect
import logging
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
        """Run the listener; an exception, a timeout or a bad result is a failure."""
        c = self.consumer
        timeout = c.config.consume_timeout_s
        failed = self.failure
        try:
            listener = c.listener
            async with asyncio.timeout(timeout):  # no task per call, unlike wait_for
                if c._executor is None:
                    result = await listener(batch, ctx)  # type: ignore[misc]
                else:
                    loop = asyncio.get_running_loop()
                    result = await loop.run_in_executor(c._executor, listener, batch, ctx)
                if inspect.isawaitable(result):  # e.g. an object with an async __call__
                    result = await result
            return ConsumeStatus.SUCCESS if result is None else ConsumeStatus(result)
        except TimeoutError:
            log.warning("listener exceeded the consume timeout of %.0fs on %s; retrying",
                        timeout, ctx.queue)
            return failed
        except Exception:
            # includes a result that is no ConsumeStatus: it must not leave the batch in
            # flight forever, holding the queue's commit offset back
            log.exception("listener failed on %s; retrying the batch", ctx.queue)
            return failed
