"""Orderly consumption: each queue is consumed strictly in offset order, one batch at a
time (RocketMQ's ``ConsumeMessageOrderlyService``, with its known defects fixed).

CLUSTERING: a newly assigned queue is taken only after the broker's queue lock is granted
(``LOCK_QUEUES``); the locks are renewed every ``lock_renew_s`` (20 s); a queue whose lock
was last confirmed more than ``lock_max_age_s`` (30 s) ago stops pulling and consuming until
it is locked again, and a lock the broker refused on renewal makes the consumer drop the
queue and take it afresh (lock, then read the group's offset). On revoke the running batch
finishes (bounded by the drain timeout), then one ``UNLOCK_QUEUES`` call commits the offset
and releases the lock, in that order on the broker: the next holder starts exactly after
the last success (RocketMQ unlocked before committing, issue #4086). A batch still running
after the drain timeout keeps the lock until it ends; its queue is not taken again
meanwhile.

BROADCASTING: no broker lock (every member consumes every queue); order is kept locally.

The listener returns SUCCESS or SUSPEND (an exception or a timeout counts as SUSPEND):
the queue pauses for ``ctx.suspend_ms`` (default ``suspend_s``, 1 s; bounded to 10 ms..30 s)
and the same messages are given again, in place. With ``orderly_max_retries`` set, messages
that still fail after that many retries go to the group's DLQ and the queue moves on.
A run of one queue yields after ``orderly_yield_s`` (60 s) of continuous consumption.
The offset to commit moves only after a success.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..log.record import MessageExt
from ..protocol.errors import OnceqError
from ..protocol.replies import Locked
from ..protocol.requests import LockQueues, QueueRef, UnlockQueues
from .allocation import MessageQueue
from .connection import BrokerConnection, call
from .consume import ConsumeContext, Rest
from .consume_concurrent import restore_origin_topic
from .consume_service import DEAD_LETTER_LEVEL, ConsumeService
from .process_queue import ProcessQueue

log = logging.getLogger("onceq.consumer")

SUSPEND_MIN_S = 0.01
SUSPEND_MAX_S = 30.0


def suspend_seconds(ctx_ms: int, default_s: float) -> float:
    """How long SUSPEND pauses a queue: the listener's ``suspend_ms``, else the setting."""
    s = ctx_ms / 1000 if ctx_ms > 0 else default_s
    return min(max(s, SUSPEND_MIN_S), SUSPEND_MAX_S)


class OrderlyConsumeService(ConsumeService):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.locking = self.clustering  # broadcasting: no broker lock
        self._sem = asyncio.Semaphore(self.config.concurrency)
        self._runs: dict[ProcessQueue, asyncio.Task[None]] = {}  # one per queue at a time
        # runs of process queues dropped by an offset reset, maybe still in a listener call:
        # the next run of the same queue starts after them
        self._ending: dict[MessageQueue, asyncio.Task[None]] = {}
        self._locked_at: dict[MessageQueue, float] = {}  # last grant or renewal
        self._late: dict[MessageQueue, asyncio.Task[None]] = {}  # runs past the drain
        self._later: set[asyncio.Task[None]] = set()  # their unlocks (a reference each)

    # ---------------------------------------------------------------- locks
    async def _lock(self, mqs: list[MessageQueue], conn: BrokerConnection | None = None
                    ) -> set[MessageQueue]:
        r = self.requester
        request = LockQueues(r.group, r.client_id, [QueueRef(mq.topic, mq.queue_id)
                                                    for mq in mqs])
        reply: Locked = await (r.call(request) if conn is None else call(conn, request))
        held = {MessageQueue(t, q) for t, q in reply.locked}
        now = r.clock()
        for mq in held:
            self._locked_at[mq] = now
        return held

    async def acquire(self, mqs: list[MessageQueue]) -> set[MessageQueue]:
        r = self.requester
        free = [mq for mq in mqs if mq not in self._late]  # an old run still going
        held = set(free)
        if self.locking and free:
            try:
                held = await self._lock(free)
            except OnceqError as exc:
                log.warning("%s: lock of %d queue(s) failed: %s", r.client_id, len(free), exc)
                held = set()
        if len(held) < len(mqs):
            r.stats["lock_refused"] += len(mqs) - len(held)
            asyncio.get_running_loop().call_later(self.config.lock_retry_s, r.rebalance_soon)
        return held

    def locked(self, mq: MessageQueue) -> bool:
        """Whether ``mq`` may be pulled and consumed now (its lock is fresh enough)."""
        if not self.locking:
            return True
        at = self._locked_at.get(mq)
        return at is not None and self.requester.clock() - at <= self.config.lock_max_age_s

    def may_pull(self, pq: ProcessQueue) -> bool:
        return self.locked(pq.mq)

    async def reconnected(self, conn: BrokerConnection) -> None:
        """Lock the owned queues again at once (a restarted broker has no locks), rather
        than at the next renewal; queues another member locked meanwhile are dropped."""
        if self.locking:
            conn.lost.add_done_callback(lambda _f: self._connection_lost(conn))
            try:
                await self.renew(conn)
            except OnceqError as exc:  # the renewal loop tries again
                log.debug("relock after reconnect failed: %s", exc)

    def _connection_lost(self, conn: BrokerConnection) -> None:
        """The broker frees a disconnected member's locks at once, so another member may
        take its queues now: stop consuming them after the calls running (not when the
        locks reach their maximum age); they are locked again after the reconnect."""
        if self.requester.is_current(conn):  # not an old connection closed late
            self._locked_at.clear()

    async def renew(self, conn: BrokerConnection | None = None) -> None:
        """Renew the locks of every owned queue; drop the queues whose lock was refused."""
        if not self.locking:
            return
        r = self.requester
        owned = [(mq, pq) for mq, pq in self.assignment.items() if self.assignment.active(pq)]
        if not owned:
            return
        held = await self._lock([mq for mq, _ in owned], conn)
        for mq, pq in owned:
            if mq in held:
                if len(pq) and pq not in self._runs:
                    self._kick(pq)  # stopped for an old lock: go on
                continue
            # another member holds it now (ours expired): what we cached is stale. Drop the
            # queue; the rebalance takes it afresh (lock, then the group's offset)
            self._locked_at.pop(mq, None)
            r.stats["lock_lost"] += 1
            log.warning("%s: lock of %s lost; dropping the queue", r.client_id, mq)
            r.drop_soon(mq)

    # ---------------------------------------------------------------- consuming
    def dispatch(self, pq: ProcessQueue, msgs: list[MessageExt]) -> None:
        if pq not in self._runs:
            self._kick(pq)

    def _kick(self, pq: ProcessQueue) -> None:
        if not self.assignment.active(pq) or pq in self._runs:
            return
        self._runs[pq] = asyncio.get_running_loop().create_task(self._run(pq))

    async def _run(self, pq: ProcessQueue) -> None:
        try:
            ending = self._ending.pop(pq.mq, None)
            if ending is not None:  # never two listener calls on one queue at once
                await asyncio.wait([ending])
            await self._run_batches(pq)
        finally:
            # at once, not in a done callback: messages dispatched between this run's last
            # look at the queue and a callback would find the run still listed and wait
            # for the next lock renewal to be consumed
            if self._runs.get(pq) is asyncio.current_task():
                del self._runs[pq]

    async def _run_batches(self, pq: ProcessQueue) -> None:
        """Consume ``pq`` batch after batch, in order, until it is empty or must stop."""
        r = self.requester
        cfg = self.config
        started = r.clock()
        while self.assignment.active(pq) and self.locked(pq.mq):
            if r.clock() - started > cfg.orderly_yield_s:
                r.stats["yielded"] += 1  # let the other queues' runs have the loop
                asyncio.get_running_loop().call_soon(self._kick, pq)
                return
            batch = pq.head(cfg.batch_size)
            if not batch:
                return
            if not await self._consume(pq, batch):
                return  # revoked or lock too old while suspended: messages stay in place

    async def _consume(self, pq: ProcessQueue, batch: list[MessageExt]) -> bool:
        """Run the listener on ``batch`` until it succeeds (or goes to the DLQ), removing
        what is done from ``pq``; False when the queue must stop first.

        SUCCESS with an ``ack_index`` before the batch's end (partial success, as the
        idempotency layer answers) consumes the messages up to it; the rest are suspended
        and retried in place, in order."""
        r = self.requester
        cfg = self.config
        restore_origin_topic(batch)
        attempt = 1
        while True:
            ctx = ConsumeContext(pq.mq, len(batch) - 1, group=r.group, attempt=attempt)
            async with self._sem:
                result = await self.runner.run_bounded(batch, ctx)
            acked = result.acked
            if acked and ctx.replies:  # requests answered
                self.send_replies(batch[:acked], ctx.replies)
            if acked:
                pq.remove(batch[:acked])
                r.stats["consumed"] += acked
                batch = batch[acked:]
                attempt = 0  # the first message not done is tried again afresh
            if not batch:
                return True
            if result.rest is Rest.DEAD_LETTER:  # the rest is for the DLQ (e.g. the
                # idempotency layer's verdict: no key, or another payload): retrying
                # cannot help
                reasons = [result.reasons.get(acked + i) for i in range(len(batch))]
                if await self._to_dlq(pq, batch, reasons):
                    pq.remove(batch)
                    return True
            r.stats["suspended"] += 1
            limit = cfg.orderly_max_retries
            if limit is not None and attempt > limit and await self._to_dlq(pq, batch):
                pq.remove(batch)
                return True
            attempt += 1
            await asyncio.sleep(suspend_seconds(result.suspend_ms, cfg.suspend_s))
            if not (self.assignment.active(pq) and self.locked(pq.mq)):
                return False

    async def _to_dlq(self, pq: ProcessQueue, batch: list[MessageExt],
                      reasons: list[str | None] | None = None) -> bool:
        """Out of retries, or dead-lettered by the listener: the messages go to the group's
        DLQ, each with its reason when it has one (broadcasting: skipped)."""
        r = self.requester
        if not self.clustering:
            log.warning("broadcasting: %d message(s) on %s failed %d times; skipped",
                        len(batch), pq.mq, self.config.orderly_max_retries)
            return True
        try:
            for i, m in enumerate(batch):
                await self.send_back(pq, m, DEAD_LETTER_LEVEL, reasons[i] if reasons else None)
        except OnceqError as exc:  # suspend again and retry the whole batch later
            log.warning("%s: dead-lettering on %s failed: %s", r.client_id, pq.mq, exc)
            return False
        r.stats["dlq"] += len(batch)
        return True

    # ---------------------------------------------------------------- revoke
    async def drain(self, pq: ProcessQueue) -> None:
        task = self._runs.get(pq)
        if task is None:
            return
        done, _ = await asyncio.wait([task], timeout=self.config.drain_timeout_s)
        if not done:
            log.warning("%s: a listener call on %s still runs after the drain timeout; "
                        "the queue stays locked until it ends", self.requester.client_id,
                        pq.mq)
            self._late[pq.mq] = task

    def forget(self, pq: ProcessQueue) -> None:
        task = self._runs.pop(pq, None)
        if task is not None and not task.done():
            self._ending[pq.mq] = task  # it stops after its current call (pq is inactive)

    async def release(self, pq: ProcessQueue) -> None:
        mq = pq.mq
        late = self._late.get(mq)
        if late is not None:  # commit and unlock when the last batch ends
            late.add_done_callback(lambda _t: self._later.add(
                asyncio.get_running_loop().create_task(self._release_late(pq))))
            return
        await self._unlock(pq)

    async def _release_late(self, pq: ProcessQueue) -> None:
        try:
            await self._unlock(pq)
        except OnceqError as exc:  # the lock expires on the broker after 60 s
            log.warning("%s: late unlock of %s failed: %s", self.requester.client_id, pq.mq,
                        exc)
        finally:
            self._late.pop(pq.mq, None)
            self._later.discard(asyncio.current_task())  # type: ignore[arg-type]

    async def _unlock(self, pq: ProcessQueue) -> None:
        """Commit the offset of ``pq``, then release its lock: one call, in that order."""
        r = self.requester
        self._locked_at.pop(pq.mq, None)
        if not self.locking:
            await self.offsets.release(pq)
            return
        ref = QueueRef(pq.mq.topic, pq.mq.queue_id, None if pq.stale else pq.commit_offset)
        await r.call(UnlockQueues(r.group, r.client_id, [ref], r.reset_gen))
