"""The fetcher: one pull loop per owned queue (RocketMQ's ``PullMessageService``).

A loop pulls its queue with long polling, carries the queue's commit offset on each pull
(the offset store says when), and hands what it pulls to the consume service. Flow control
pauses it (too many, too large or too wide in flight), and so does an orderly queue whose
lock is being renewed, or a lease that lapsed while the member was away.

Each answer is checked against the assignment's generation before it is applied: a pull
answered after its queue was dropped (lost, reset) or taken again is thrown away.
"""

from __future__ import annotations

import asyncio
import logging

from ..log.batch import CodecUnavailable
from ..log.record import MessageExt, RecordError, decode_records
from ..protocol.codes import PullStatus
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import PullReply
from ..protocol.requests import Pull
from .allocation import MessageQueue
from .assignment import Assignment
from .consume_service import ConsumeService
from .offset_store import OffsetStore
from .process_queue import ProcessQueue
from .pull import parse_tags
from .push_config import PushConsumerConfig
from .requester import Requester

log = logging.getLogger("onceq.consumer")
CODEC_BACKOFF_S = 5.0  # a batch compressed with a codec not installed here: pulled again


class Fetcher:
    def __init__(self, requester: Requester, config: PushConsumerConfig,
                 assignment: Assignment, offsets: OffsetStore, service: ConsumeService,
                 subscriptions: dict[str, str]) -> None:
        self.r = requester
        self.config = config
        self.assignment = assignment
        self.offsets = offsets
        self.service = service
        self.subscriptions = subscriptions
        self._loops: dict[MessageQueue, asyncio.Task[None]] = {}

    def start(self, pq: ProcessQueue) -> None:
        """Start pulling ``pq`` (just taken)."""
        self._loops[pq.mq] = asyncio.get_running_loop().create_task(
            self._loop(pq), name=f"onceq-pull-{pq.mq.topic}-{pq.mq.queue_id}")

    async def stop(self, mq: MessageQueue) -> None:
        """Stop pulling ``mq`` and wait until its loop has ended."""
        task = self._loops.pop(mq, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _request(self, pq: ProcessQueue, tags: list[str] | None, commit: int | None) -> Pull:
        cfg, r, mq = self.config, self.r, pq.mq
        return Pull(mq.topic, mq.queue_id, pq.next_offset, cfg.pull_batch_size,
                    suspend_ms=int(cfg.pull_suspend_s * 1000), tags=tags, group=r.group,
                    client=r.client_id, commit=commit, reset_gen=r.reset_gen)

    async def _loop(self, pq: ProcessQueue) -> None:
        cfg, r = self.config, self.r
        tags = parse_tags(self.subscriptions.get(pq.mq.topic, "*"))
        wanted = set(tags) if tags else None
        failures = 0
        while self.assignment.active(pq):
            if pq.flow_blocked(cfg.flow_count, cfg.flow_bytes, cfg.flow_span):
                pq.last_pull = r.clock()  # alive, just throttled
                r.stats["flow_paused"] += 1
                await asyncio.sleep(cfg.flow_pause_s)
                continue
            if not self.service.may_pull(pq):  # orderly: the queue's lock is being renewed
                pq.last_pull = r.clock()
                await asyncio.sleep(cfg.locked_backoff_s)
                continue
            if r.lease_lapsed(pq):  # away (paused): is the queue still ours?
                await r.confirm_lease(pq)
                continue
            commit = self.offsets.piggyback(pq.mq, pq.commit_offset)
            sent = r.clock()
            pulled = pq.next_offset
            try:
                reply: PullReply = await r.call(self._request(pq, tags, commit),
                                                timeout=cfg.pull_suspend_s + 10)
            except OnceqError as exc:
                if exc.code in (ErrorCode.TOPIC_NOT_EXIST, ErrorCode.INVALID_QUEUE):
                    # the topic was deleted (maybe re-created, offsets from 0 again): the
                    # next rebalance drops this queue and takes it afresh if it exists
                    log.warning("pull %s: %s; queue dropped until the next rebalance",
                                pq.mq, exc.message)
                    r.drop_soon(pq.mq)
                    return
                if exc.code == ErrorCode.WRONG_GROUP:  # the queue moved to another group:
                    r.drop_soon(pq.mq)  # the next rebalance reads its route again
                    return
                failures += 1
                log.debug("pull %s failed: %s", pq.mq, exc)
                await asyncio.sleep(min(0.05 * 2 ** failures, 3.0))
                continue
            failures = 0
            if not self.assignment.current(pq, pq.generation):
                return  # dropped or taken again while the pull was out: not ours to apply
            pq.last_pull = r.clock()
            if not await self._apply(pq, reply, commit, sent, wanted, pulled):
                return

    async def _apply(self, pq: ProcessQueue, reply: PullReply, commit: int | None,
                     sent: float, wanted: set[str] | None, pulled: int) -> bool:
        """Apply one pull's answer to ``pq`` (of the current generation); False when the
        loop must end (the queue was lost)."""
        cfg, r, mq = self.config, self.r, pq.mq
        status = reply.status
        if status == PullStatus.LOCKED:
            if pq.confirmed_at is not None:  # it held the queue: another holds it now
                r.lose([pq], "another member holds its lock")
                return False
        elif reply.behind is not None:  # its commit was below the group's: it moved on
            r.lose([pq], f"the group committed {reply.behind}, past its position {commit}")
            return False
        else:
            r.confirmed(pq, sent)
            if commit is not None:  # a refused pull's commit was not applied: sent again
                self.offsets.carried(mq, commit)
        if status == PullStatus.FOUND:
            try:
                msgs = list(decode_records(reply.payload, first=pulled, end=reply.next)
                            ) if reply.payload else []
            except CodecUnavailable as exc:  # nothing to retry for: say so, loudly
                log.error("pull %s at %d: %s; this queue waits until it is installed",
                          mq, pq.next_offset, exc)
                await asyncio.sleep(CODEC_BACKOFF_S)
                return True
            except RecordError as exc:  # damaged in transit: pull the same range again
                log.warning("pull %s at %d: %s; pulling again", mq, pq.next_offset, exc)
                await asyncio.sleep(cfg.locked_backoff_s)
                return True
            if not self.assignment.active(pq):  # revoked meanwhile: the next owner's
                return False
            self._hand_on(pq, msgs, reply.next, wanted)
        elif status == PullStatus.LOCKED:
            # the previous owner is still draining this queue: retry shortly
            r.stats["locked"] += 1
            await asyncio.sleep(cfg.locked_backoff_s)
        elif reply.next < pq.next_offset:
            # the broker moved us back (the queue ends below what we pulled): continue
            # there once nothing is in flight, and commit the corrected offset
            if len(pq):
                await asyncio.sleep(cfg.flow_pause_s)
                return True
            log.warning("pull %s at %d: %s, continuing at %d", mq, pq.next_offset,
                        status.name, reply.next)
            pq.rewind(reply.next)
            self.offsets.moved_back(mq)  # let the next pull commit the lower offset
        else:
            if status != PullStatus.NO_NEW_MESSAGE:
                log.warning("pull %s at %d: %s, continuing at %d", mq, pq.next_offset,
                            status.name, reply.next)
            pq.next_offset = reply.next
        return True

    def _hand_on(self, pq: ProcessQueue, msgs: list[MessageExt], next_offset: int,
                 wanted: set[str] | None) -> None:
        if wanted is not None:
            msgs = [m for m in msgs if m.tags in wanted]
        pq.add(msgs)
        pq.next_offset = next_offset
        self.service.dispatch(pq, msgs)

