"""The consume-service interface: what a push consumer does with what it pulled.

A push consumer hands the messages it pulls to one consume service (RocketMQ's
``ConsumeMessageConcurrentlyService`` / ``ConsumeMessageOrderlyService`` split):
:class:`~onceq.client.consume_concurrent.ConcurrentConsumeService` runs listener calls in
parallel and sends failures to the retry topic; :class:`~onceq.client.consume_orderly.
OrderlyConsumeService` runs one batch of a queue at a time, in offset order, under a broker
queue lock. The service is chosen by the listener kind (``orderly``) or the ``orderly``
setting. A service talks to the broker through a :class:`~onceq.client.requester.Requester`
and calls the listener through a :class:`~onceq.client.runner.ListenerRunner`.
"""

from __future__ import annotations

from collections.abc import Callable

from ..log.record import MessageExt
from ..protocol.codes import MAX_DLQ_REASON
from ..protocol.requests import SendBack
from .allocation import MessageQueue
from .assignment import Assignment
from .connection import BrokerConnection
from .offset_store import OffsetStore
from .process_queue import ProcessQueue
from .push_config import MessageModel, PushConsumerConfig
from .requester import Requester
from .runner import ListenerRunner

DEAD_LETTER_LEVEL = -1  # the wire's delay level of a send-back straight to the DLQ


class ConsumeService:
    """Runs the listener on what the fetcher pulled. One instance per consumer."""

    def __init__(self, requester: Requester, config: PushConsumerConfig,
                 assignment: Assignment, offsets: OffsetStore, runner: ListenerRunner
                 ) -> None:
        self.requester = requester
        self.config = config
        self.assignment = assignment
        self.offsets = offsets
        self.runner = runner
        self.clustering = config.model == MessageModel.CLUSTERING
        # request-reply: sends the replies of acknowledged requests (responder.py)
        self.replier: Callable[[list[MessageExt], dict[int, bytes]], None] | None = None

    def start(self) -> None:
        """Start background work (the consumer is running)."""

    def send_replies(self, done: list[MessageExt], replies: dict[int, bytes]) -> None:
        """The listener acknowledged ``done`` and answered requests (``ctx.replies``):
        send those replies."""
        if self.replier is not None:
            self.replier(done, replies)

    async def stop(self) -> None:
        """Stop background work (after every queue was released)."""

    async def acquire(self, mqs: list[MessageQueue]) -> set[MessageQueue]:
        """Before newly assigned queues are taken: those that may be taken now (the others
        are left for a later rebalance)."""
        return set(mqs)

    def may_pull(self, pq: ProcessQueue) -> bool:
        """Whether the fetcher may pull ``pq`` now (else it waits a moment)."""
        return True

    def dispatch(self, pq: ProcessQueue, msgs: list[MessageExt]) -> None:
        """Messages just added to ``pq``: have them consumed."""
        raise NotImplementedError

    async def drain(self, pq: ProcessQueue) -> None:
        """``pq`` is revoked: wait (bounded by the drain timeout) for its listener calls."""
        raise NotImplementedError

    def forget(self, pq: ProcessQueue) -> None:
        """``pq`` was dropped without a drain (an offset reset): results are thrown away."""

    async def renew(self, conn: BrokerConnection | None = None) -> None:
        """Renew the broker locks the service holds (the coordinator calls this)."""

    async def reconnected(self, conn: BrokerConnection) -> None:
        """A new broker connection, before other requests use it."""

    async def release(self, pq: ProcessQueue) -> None:
        """Last step of a revoke: commit the offset of ``pq``, then give the queue up."""
        await self.offsets.release(pq)

    async def send_back(self, pq: ProcessQueue, m: MessageExt, delay_level: int,
                        dlq_reason: str | None = None) -> None:
        """Hand one message to the broker's retry path (``DEAD_LETTER_LEVEL``: straight to
        the DLQ); ``dlq_reason`` goes into its ``DLQ_REASON`` property if it ends there."""
        r = self.requester
        await r.call(SendBack(r.group, pq.mq.topic, pq.mq.queue_id, m.queue_offset,
                              delay_level, self.config.max_reconsume,
                              (dlq_reason or "")[:MAX_DLQ_REASON]))
        r.stats["sent_back"] += 1
