"""Concurrent consumption: listener calls run in parallel (bounded), failures are retried
through the group's retry topic (RocketMQ's ``ConsumeMessageConcurrentlyService``).

The committed offset of a queue is its lowest in-flight offset, so a slow message holds it
back; on revoke, running calls finish within the drain timeout before the final commit.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..log.record import MessageExt
from ..protocol.codes import PROP_ORIGIN_TOPIC, RETRY_PREFIX
from ..protocol.errors import OnceqError
from .consume import ConsumeContext, Rest
from .consume_service import DEAD_LETTER_LEVEL, ConsumeService
from .process_queue import ProcessQueue

log = logging.getLogger("onceq.consumer")


def restore_origin_topic(batch: list[MessageExt]) -> None:
    """A retried message shows the topic it was first sent to, not the retry topic."""
    for m in batch:
        origin = m.properties.get(PROP_ORIGIN_TOPIC)
        if origin is not None and m.topic.startswith(RETRY_PREFIX):
            m.topic = origin


class ConcurrentConsumeService(ConsumeService):
    """``concurrency`` worker coroutines take listener batches from one queue, so at most
    that many listener calls run at once; a batch of a revoked queue is skipped when its
    turn comes.

    The consume timeout is one timer for all workers, set for the oldest call running:
    when it fires, the workers whose call is over time are cancelled (the call counts as
    failed) and the timer moves to the next oldest call. At listener batch 1 a task per
    batch, or a timer per call, would cost more than the rest of the consumer.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._todo: asyncio.Queue[tuple[ProcessQueue, list[MessageExt]] | None] = \
            asyncio.Queue()
        self._workers: list[asyncio.Task[None]] = []
        self._busy: dict[ProcessQueue, int] = {}  # batches started and not settled, by queue
        self._idle: dict[ProcessQueue, asyncio.Future[None]] = {}  # drains waiting on _busy
        self._tasks: set[asyncio.Task[None]] = set()  # send-backs (a reference each)
        n = self.config.concurrency
        self._since: list[float | None] = [None] * n  # when each worker's call started
        self._expired = [False] * n  # the timer cancelled the worker's call
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._workers = [loop.create_task(self._work(i), name=f"onceq-consume-{i}")
                         for i in range(self.config.concurrency)]

    async def stop(self) -> None:
        # no cancel: a call still running past the drain timeout ends on its own
        for _ in self._workers:
            self._todo.put_nowait(None)

    def _time(self) -> None:
        """Cancel the calls over the consume timeout; set the timer for the next one."""
        timeout = self.config.consume_timeout_s
        loop = asyncio.get_running_loop()
        now = loop.time()
        oldest = None
        for i, since in enumerate(self._since):
            if since is None or self._expired[i]:
                continue
            if since + timeout <= now:
                self._expired[i] = True
                self._workers[i].cancel()
            elif oldest is None or since < oldest:
                oldest = since
        self._timer = None if oldest is None else loop.call_at(oldest + timeout, self._time)

    def dispatch(self, pq: ProcessQueue, msgs: list[MessageExt]) -> None:
        if not self.assignment.active(pq):
            return
        size = self.config.batch_size
        put = self._todo.put_nowait
        for i in range(0, len(msgs), size):
            put((pq, msgs[i:i + size]))

    async def drain(self, pq: ProcessQueue) -> None:
        # batches not started yet are skipped by the workers (the queue is dropped); a
        # revoke cancelled mid-drain (a shutdown during a rebalance) is done again, and
        # waits for the same calls
        if not self._busy.get(pq):
            return
        idle = self._idle.get(pq)
        if idle is None:
            idle = self._idle[pq] = asyncio.get_running_loop().create_future()
        done, _ = await asyncio.wait([idle], timeout=self.config.drain_timeout_s)
        if not done:
            log.warning("%s: %d listener call(s) on %s still running after the drain "
                        "timeout; their messages will be redelivered",
                        self.requester.client_id, self._busy.get(pq, 0), pq.mq)

    def _started(self, pq: ProcessQueue) -> None:
        self._busy[pq] = self._busy.get(pq, 0) + 1

    def _settled(self, pq: ProcessQueue) -> None:
        n = self._busy[pq] - 1
        if n:
            self._busy[pq] = n
            return
        del self._busy[pq]
        idle = self._idle.pop(pq, None)
        if idle is not None and not idle.done():
            idle.set_result(None)

    async def _work(self, i: int) -> None:
        get = self._todo.get
        loop = asyncio.get_running_loop()
        calls = 0
        while (item := await get()) is not None:
            pq, batch = item
            if pq.dropped:
                continue  # not started before the revoke: the next owner gets it
            if self.requester.lease_lapsed(pq):  # away longer than the broker keeps a lock:
                await self.requester.confirm_lease(pq)  # is the queue still ours?
                if pq.dropped:
                    continue
            self._started(pq)
            handed_on = False
            try:
                self._since[i] = loop.time()
                if self._timer is None:
                    self._timer = loop.call_at(self._since[i] + self.config.consume_timeout_s,
                                               self._time)
                handed_on = await self._consume(pq, batch, i)
            except Exception:  # a worker must survive whatever one batch does
                log.exception("consuming a batch of %s failed", pq.mq)
            finally:
                self._since[i] = None
                if not handed_on:
                    self._settled(pq)
            calls += 1
            if calls % 64 == 0:  # listeners that never wait: let pulls and timers run
                await asyncio.sleep(0)

    async def _consume(self, pq: ProcessQueue, batch: list[MessageExt], w: int) -> bool:
        """Worker ``w``'s listener call and its result; True when a send-back task goes on
        with it (and settles the batch)."""
        r = self.requester
        generation = pq.generation
        restore_origin_topic(batch)
        ctx = ConsumeContext(pq.mq, len(batch) - 1, group=r.group)
        try:
            result = await self.runner.run(batch, ctx)
        except asyncio.CancelledError:
            if not self._expired[w]:
                raise
            result = self.runner.timed_out(ctx)
        finally:
            self._since[w] = None  # the call is over: the timer leaves the worker alone
            if self._expired[w]:  # the timer's cancel, taken (a timeout) or swallowed
                self._expired[w] = False
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
        done, failed = batch[:result.acked], batch[result.acked:]
        if ctx.replies and done:  # requests answered: their effect is done, whoever commits
            self.send_replies(done, ctx.replies)
        if not self.assignment.current(pq, generation):
            # finished after the queue was released (the drain timeout passed) or dropped:
            # its next owner re-reads these messages from the committed offset; a send-back
            # now would add a second copy
            if not pq.stale:  # or the group moved on without it: expected, not a warning
                log.warning("listener finished on %s after its queue was released; result "
                            "dropped", pq.mq)
            return False
        r.stats["consumed"] += len(done)
        if not failed:
            pq.remove(done)
            return False
        r.stats["failed"] += len(failed)
        level = DEAD_LETTER_LEVEL if result.rest is Rest.DEAD_LETTER else result.delay_level
        reasons = {m.queue_offset: result.reasons[i] for i, m in enumerate(batch)
                   if i in result.reasons} if result.reasons else {}
        # the send-back goes on beside the workers: a slow broker must not hold a worker
        t = asyncio.get_running_loop().create_task(
            self._finish(pq, done, failed, level, reasons))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return True

    async def _finish(self, pq: ProcessQueue, done: list[MessageExt], failed: list[MessageExt],
                      delay_level: int, reasons: dict[int, str]) -> None:
        try:
            done += await self._send_back(pq, failed, delay_level, reasons)
            pq.remove(done)
        finally:
            self._settled(pq)

    async def _send_back(self, pq: ProcessQueue, failed: list[MessageExt], delay_level: int,
                         reasons: dict[int, str] | None = None) -> list[MessageExt]:
        """Hand failed messages to the broker's retry path; return those it took.

        Broadcasting has no retry topic: failed messages are logged and skipped, like
        RocketMQ. Messages the broker could not take are retried locally later.
        """
        if not self.clustering:
            log.warning("broadcasting: %d failed message(s) on %s are not retried",
                        len(failed), pq.mq)
            return failed
        taken = []
        later = []
        for m in failed:
            try:
                await self.send_back(pq, m, delay_level, (reasons or {}).get(m.queue_offset))
                taken.append(m)
            except OnceqError as exc:
                log.warning("send back of %s@%d failed (%s); retrying locally", pq.mq,
                            m.queue_offset, exc)
                later.append(m)
        if later and not pq.dropped:
            loop = asyncio.get_running_loop()
            loop.call_later(self.config.send_back_retry_s, self.dispatch, pq, later)
        return taken
