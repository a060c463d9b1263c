"""Concurrent consumption: listener calls run in parallel (bounded), failures are retried
through the group's retry topic (RocketMQ's ``ConsumeMessageConcurrentlyService``).

The committed offset of a queue is its lowest in-flight offset, so a slow message holds it
back; on revoke, running calls finish within the drain timeout before the final commit.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ..log.record import MessageExt
from ..protocol.codes import MAX_DLQ_REASON, PROP_ORIGIN_TOPIC, RETRY_PREFIX, RequestCode
from ..protocol.errors import OnceqError
from .consume import ConsumeContext, ConsumeService, ConsumeStatus
from .process_queue import ProcessQueue

if TYPE_CHECKING:
    from .push import PushConsumer

log = logging.getLogger("onceq.consumer")


def restore_origin_topic(batch: list[MessageExt]) -> None:
    """A retried message shows the topic it was first sent to, not the retry topic."""
    for m in batch:
        origin = m.properties.get(PROP_ORIGIN_TOPIC)
        if origin is not None and m.topic.startswith(RETRY_PREFIX):
            m.topic = origin


class ConcurrentConsumeService(ConsumeService):
    def __init__(self, consumer: PushConsumer) -> None:
        super().__init__(consumer)
        self._sem = asyncio.Semaphore(consumer.config.concurrency)
        self._running: dict[ProcessQueue, set[asyncio.Task[None]]] = {}

    def dispatch(self, pq: ProcessQueue, msgs: list[MessageExt]) -> None:
        if not self.consumer.owned.active(pq):
            return
        size = self.consumer.config.batch_size
        running = self._running.setdefault(pq, set())
        loop = asyncio.get_running_loop()
        for i in range(0, len(msgs), size):
            t = loop.create_task(self._consume(pq, msgs[i:i + size]))
            running.add(t)
            t.add_done_callback(running.discard)

    async def drain(self, pq: ProcessQueue) -> None:
        # not popped before the wait: a revoke cancelled mid-drain (a shutdown during a
        # rebalance) is done again, and must wait for the same calls
        running = self._running.get(pq)
        if running:
            _, pending = await asyncio.wait(running, timeout=self.consumer.config.drain_timeout_s)
            if pending:
                log.warning("%s: %d listener call(s) on %s still running after the drain "
                            "timeout; their messages will be redelivered",
                            self.consumer.client_id, len(pending), pq.mq)
        self._running.pop(pq, None)

    def forget(self, pq: ProcessQueue) -> None:
        self._running.pop(pq, None)

    async def _consume(self, pq: ProcessQueue, batch: list[MessageExt]) -> None:
        c = self.consumer
        async with self._sem:
            if pq.dropped:
                return  # not started before the revoke: the next owner gets it
            restore_origin_topic(batch)
            ctx = ConsumeContext(pq.mq, len(batch) - 1, group=c.group)
            status = await self.call_listener(batch, ctx)
        if status == ConsumeStatus.SUCCESS:
            # clamp: a negative index would slice from the end and drop failed messages
            acked = min(max(ctx.ack_index, -1), len(batch) - 1) + 1
            done = batch[:acked]
            failed = batch[acked:]
        else:
            done, failed = [], batch
        if pq.released:
            # finished after the drain timeout: the queue's next owner re-reads these
            # messages from the committed offset; a send-back now would add a second copy
            if pq.reset:  # or the group's offsets were reset: expected, not a warning
                return
            log.warning("listener finished on %s after its queue was released; result "
                        "dropped", pq.mq)
            return
        c.stats["consumed"] += len(done)
        if failed:
            c.stats["failed"] += len(failed)
            reasons = {m.queue_offset: ctx.dlq_reasons[i] for i, m in enumerate(batch)
                       if i in ctx.dlq_reasons} if ctx.dlq_reasons else {}
            done += await self._send_back(pq, failed, ctx.delay_level, reasons)
        pq.remove(done)

    async def _send_back(self, pq: ProcessQueue, failed: list[MessageExt], delay_level: int,
                         reasons: dict[int, str] | None = None) -> list[MessageExt]:
        """Hand failed messages to the broker's retry path; return those it took.

        Broadcasting has no retry topic: failed messages are logged and skipped, like
        RocketMQ. Messages the broker could not take are retried locally later.
        """
        c = self.consumer
        if not c.clustering:
            log.warning("broadcasting: %d failed message(s) on %s are not retried",
                        len(failed), pq.mq)
            return failed
        taken = []
        later = []
        for m in failed:
            try:
                await send_back(c, pq, m, delay_level, (reasons or {}).get(m.queue_offset))
                taken.append(m)
            except OnceqError as exc:
                log.warning("send back of %s@%d failed (%s); retrying locally", pq.mq,
                            m.queue_offset, exc)
                later.append(m)
        if later and not pq.dropped:
            loop = asyncio.get_running_loop()
            loop.call_later(c.config.send_back_retry_s, self.dispatch, pq, later)
        return taken


async def send_back(c: PushConsumer, pq: ProcessQueue, m: MessageExt, delay_level: int,
                    dlq_reason: str | None = None) -> None:
    """Hand one message to the broker's retry path (delay level -1: straight to the DLQ);
    ``dlq_reason`` goes into its ``DLQ_REASON`` property if it ends in the DLQ."""
    header = {"group": c.group, "topic": pq.mq.topic, "queue": pq.mq.queue_id,
              "offset": m.queue_offset, "delay_level": delay_level,
              "max_reconsume": c.config.max_reconsume}
    if dlq_reason:
        header["dlq_reason"] = dlq_reason[:MAX_DLQ_REASON]
    await c._req(RequestCode.CONSUMER_SEND_BACK, header)
    c.stats["sent_back"] += 1
