"""The coordinator of a push consumer: its membership in the group and what changes the
queues it owns.

It sends the heartbeats (and reads their answers: the leases of the queues it holds,
forced offset resets it has not handled), runs the rebalance (its order lives in one
method, :meth:`Coordinator.rebalance`), handles the broker's reset notices, drops the
queues the group moved on without, and runs the background loops (rebalance, heartbeat,
commit, lock renewal). It is the :class:`~onceq.client.requester.Requester` the consume
service, the fetcher and the offset store talk to the broker through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from .._aio import wait_event
from ..protocol.codes import RETRY_PREFIX, retry_topic
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import (
    PUSHES,
    GroupChanged,
    GroupMembers,
    HeartbeatReply,
    OffsetReply,
    OffsetsReset,
    QueueOffsets,
    TopicInfo,
)
from ..protocol.requests import (
    GetTopic,
    GroupBeat,
    Heartbeat,
    ListGroupMembers,
    QueryOffsets,
    SearchOffset,
    Unregister,
)
from ..protocol.schema import Message
from .allocation import MessageQueue
from .assignment import Assignment
from .connection import BrokerConnection, call
from .consume_service import ConsumeService
from .fetcher import Fetcher
from .offset_store import OffsetStore
from .process_queue import ProcessQueue
from .push_config import ConsumeFrom, MessageModel, PushConsumerConfig
from .rebalance import RebalanceTimer, plan_rebalance

log = logging.getLogger("onceq.consumer")

Call = Callable[[Message, float], Awaitable[Any]]
Listed = dict[tuple[str, int], ProcessQueue]  # the process queues a heartbeat names


class Coordinator:
    def __init__(self, group: str, client_id: str, config: PushConsumerConfig,
                 clock: Callable[[], float], subscriptions: dict[str, str], orderly: bool,
                 call: Call, connection: Callable[[], BrokerConnection | None]) -> None:
        self.group = group
        self.client_id = client_id
        self.config = config
        self.clock = clock
        self.subscriptions = subscriptions
        self.orderly = orderly
        self.clustering = config.model == MessageModel.CLUSTERING
        self._call = call
        self._connection = connection
        self.assignment = Assignment()
        self.stats: Counter[str] = Counter()
        self.running = False
        # wired by the consumer before it starts
        self.offsets: OffsetStore
        self.service: ConsumeService
        self.fetcher: Fetcher
        self._reset_gen: int | None = None  # the last forced offset reset handled
        self.hold_s: float | None = None  # the broker's access-lock hold (heartbeat answer)
        # topics over several broker groups (``routes.py``, set by the consumer): a
        # topic's route; the broker group this coordinator is a member of (its queues of
        # routed topics are consumed here); and, on the consumer's own group (which also
        # consumes the topics without a route), what starts its members on the others
        self.route: Callable[[str], Awaitable[Any]] | None = None
        self.broker_group: Callable[[], str | None] = lambda: None
        self.spawn: Callable[[Any], Awaitable[None]] | None = None
        self._to_drop: set[MessageQueue] = set()  # the next rebalance drops these
        self._confirming: asyncio.Task[None] | None = None  # a heartbeat for a lapsed lease
        self._retakes: set[asyncio.Task[None]] = set()
        self._timer = RebalanceTimer(config.rebalance_interval_s, clock())
        self._wake: asyncio.Event | None = None
        self._lock = asyncio.Lock()  # one change of the assignment at a time

    # ================================================================ the requester
    async def call(self, request: Message, timeout: float = 10.0) -> Any:
        return await self._call(request, timeout)

    @property
    def reset_gen(self) -> int | None:
        return self._reset_gen

    def is_current(self, conn: BrokerConnection) -> bool:
        return self._connection() in (conn, None)

    def rebalance_soon(self) -> None:
        """Have the rebalance loop run now (not after the interval)."""
        self._timer.notify()
        if self._wake is not None:
            self._wake.set()

    def drop_soon(self, mq: MessageQueue) -> None:
        self._to_drop.add(mq)
        self.rebalance_soon()

    def lose(self, pqs: list[ProcessQueue], why: str) -> None:
        """The broker says these queues moved on without this member (its lock expired or
        was handed over while it was away, or the group committed past its position):
        what they hold in flight was, or will be, consumed by another member. Drop them
        now, without committing, and take them again from the group's offset."""
        lost = [pq for pq in pqs if self.assignment.active(pq)]
        if not lost:
            return
        self.stats["queues_lost"] += len(lost)
        log.warning("%s: %s no longer held by this member (%s); dropping %d in-flight "
                    "message(s) and taking them again from the group's offset",
                    self.client_id, ", ".join(f"{pq.mq.topic}:{pq.mq.queue_id}"
                                              for pq in lost),
                    why, sum(len(pq) for pq in lost))
        self._drop_and_retake(lost)

    # ================================================================ leases
    def confirmed(self, pq: ProcessQueue, sent: float) -> None:
        if self.hold_s is not None and (pq.confirmed_at is None or sent > pq.confirmed_at):
            pq.confirmed_at = sent

    def lease_lapsed(self, pq: ProcessQueue) -> bool:
        """Whether this member has been away (paused, cut off) long enough that the broker
        may have given the queue's lock away: no confirmation for half the hold time. Its
        in-flight messages then wait for a heartbeat's answer before a listener sees them."""
        return (self.hold_s is not None and pq.confirmed_at is not None
                and self.clock() - pq.confirmed_at >= self.hold_s / 2)

    async def confirm_lease(self, pq: ProcessQueue) -> None:
        """Wait until the broker confirmed ``pq`` again (a heartbeat now) or it was dropped.
        Concurrent callers share one heartbeat."""
        delay = 0.05
        while self.running and self.assignment.active(pq) and self.lease_lapsed(pq):
            if self._confirming is None or self._confirming.done():
                self._confirming = asyncio.get_running_loop().create_task(self.heartbeat())
            try:
                await asyncio.shield(self._confirming)
            except Exception as exc:  # the broker is out of reach: ask again after a wait
                log.debug("lease of %s not confirmed: %s", pq.mq, exc)
            if self.assignment.active(pq) and self.lease_lapsed(pq):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    # ================================================================ heartbeats
    def _heartbeat_request(self) -> tuple[Heartbeat, Listed]:
        """A heartbeat, and the process queues its ``held`` list names."""
        meta: dict[str, Any] = {"access_lock": self.config.access_lock}
        if self.orderly:
            meta["orderly"] = True
        listed: Listed = {}
        held = None
        if self.clustering:  # the queues held (draining ones too, until released)
            listed = {(mq.topic, mq.queue_id): pq
                      for mq, pq in sorted(self.assignment.items()) if not pq.released}
            held = [(t, q, pq.next_offset) for (t, q), pq in listed.items()]
        beat = GroupBeat(self.group, dict(self.subscriptions), self.config.model.value, meta,
                         held, self._reset_gen if self.clustering else None)
        return Heartbeat(self.client_id, [beat]), listed

    async def heartbeat(self) -> None:
        request, listed = self._heartbeat_request()
        sent = self.clock()
        self._on_heartbeat_reply(await self.call(request), listed, sent)

    def _on_heartbeat_reply(self, reply: HeartbeatReply, listed: Listed, sent: float
                            ) -> None:
        """Resets to handle; per listed queue whether this member still holds it: a held
        queue's lease is renewed from ``sent``, a queue it held and holds no more is lost."""
        for notice in reply.resets or ():
            if isinstance(notice, dict):
                self._on_reset(OffsetsReset.decode(notice))
        hold = reply.hold_s
        self.hold_s = float(hold) if isinstance(hold, int | float) and hold > 0 else None
        answered = {(t, q): bool(has) for g, t, q, has in reply.holds if g == self.group}
        lost = []
        for key, pq in listed.items():
            if not self.assignment.active(pq):
                continue
            if answered.get(key):
                self.confirmed(pq, sent)
            elif pq.confirmed_at is not None and self.hold_s is not None:
                lost.append(pq)  # it held the queue: not any more (or it is not there)
        self.lose(lost, "the broker gave its lock to another member or freed it")

    async def on_connected(self, conn: BrokerConnection) -> None:
        """A new connection is a new member for the broker: register before any pull goes
        out on it, or the broker would not apply the access lock. The heartbeat
        re-asserts the queues this consumer holds (the broker may have restarted), then
        the offsets of finished work are sent again."""
        if not self.running:
            return
        request, listed = self._heartbeat_request()
        sent = self.clock()
        try:
            reply: HeartbeatReply = await call(conn, request)
        except OnceqError:
            return
        self._on_heartbeat_reply(reply, listed, sent)  # resets missed while disconnected
        await self.service.reconnected(conn)  # orderly: lock the owned queues again
        await self.offsets.reconnected(conn, reply.holds, self.assignment.items())

    # ================================================================ notices
    def on_push(self, code: int, header: dict[str, Any]) -> None:
        push_type = PUSHES.get(code)
        if push_type is None:
            return
        try:
            push = push_type.decode(header)
        except OnceqError as exc:
            log.debug("push %d not understood: %s", code, exc)
            return
        if isinstance(push, GroupChanged) and push.group == self.group:
            self.rebalance_soon()
        elif isinstance(push, OffsetsReset) and push.group == self.group:
            self._on_reset(push)

    def _on_reset(self, notice: OffsetsReset) -> None:
        """An admin forced the group's offsets elsewhere: drop those process queues now,
        without committing (results still to come are thrown away), and take them again
        from the broker's offset. Synchronous up to the re-take, so no request sent after
        this carries an old position without the new generation."""
        if (notice.group != self.group or notice.gen <= (self._reset_gen or 0)
                or not self.clustering or not self.running):
            return
        keys = {(t, q) for t, q in notice.queues}
        hit = [pq for mq, pq in self.assignment.items() if (mq.topic, mq.queue_id) in keys]
        self._reset_gen = notice.gen
        self.stats["offset_resets"] += 1
        log.info("%s: offsets of group %s were reset on %d queue(s); taking %d again from "
                 "the new offsets", self.client_id, self.group, len(keys), len(hit))
        self._drop_and_retake(hit)

    def _drop_and_retake(self, pqs: list[ProcessQueue]) -> None:
        """Stop work on ``pqs`` at once, synchronously (no request sent after this carries
        their positions), commit nothing of them (results still to come are thrown away),
        and take their queues again from the broker's offset."""
        hit = [pq for pq in pqs if self.assignment.active(pq)]
        for pq in hit:
            self.assignment.drop(pq)
        if hit:
            task = asyncio.get_running_loop().create_task(self._retake(hit))
            self._retakes.add(task)
            task.add_done_callback(self._retakes.discard)

    async def _retake(self, hit: list[ProcessQueue]) -> None:
        async with self._lock:
            for pq in hit:
                mq = pq.mq
                if self.assignment.get(mq) is not pq:
                    continue  # revoked meanwhile
                await self.fetcher.stop(mq)
                self.assignment.forget(pq)
                self.service.forget(pq)
                self.offsets.forget(mq)
                if not self.running:
                    continue
                try:
                    if mq in await self.service.acquire([mq]):
                        await self._take(mq)
                except OnceqError as exc:  # the next rebalance takes it
                    log.warning("%s: could not take %s again after the reset: %s",
                                self.client_id, mq, exc)
                    self._timer.notify()

    # ================================================================ rebalance
    async def rebalance(self) -> None:
        """The rebalance, in its order: revoke what left the assignment (stop pulling,
        drain running listeners within the drain timeout, commit, release), then take the
        newly assigned queues (the orderly service first locks them on the broker)."""
        async with self._lock:
            if not self.running:
                return
            desired = await self._desired()
            now = self.clock()
            stalled = [mq for mq, pq in self.assignment.items()
                       if mq in self._to_drop or pq.pull_expired(now, self.config.pull_expire_s)]
            self._to_drop.clear()
            plan = plan_rebalance(self.assignment, desired, stalled)
            if plan.revoke or plan.assign:
                log.info("%s rebalance: revoke %s, assign %s", self.client_id,
                         [f"{q.topic}:{q.queue_id}" for q in plan.revoke],
                         [f"{q.topic}:{q.queue_id}" for q in plan.assign])
            await asyncio.gather(*(self._revoke(mq) for mq in plan.revoke))
            granted = await self.service.acquire(plan.assign)  # orderly: broker locks
            for mq in plan.assign:
                if mq in granted:
                    await self._take(mq)

    async def _topic_queues(self, topic: str) -> list[MessageQueue]:
        """The queues of ``topic`` this member consumes from its broker: of a topic with a
        route, those placed on its broker group (the members of the other groups take
        theirs); of a topic without one, all (the consumer's own group; another group's
        member takes only its group's retry topic)."""
        route = await self.route(topic) if self.route is not None else None
        if route is not None:
            if self.spawn is not None:
                await self.spawn(route)
            mine = self.broker_group()
            return [MessageQueue(topic, i) for i, g in enumerate(route.placement)
                    if g == mine]
        if self.spawn is None and topic != retry_topic(self.group):
            return []
        try:
            info: TopicInfo = await self.call(GetTopic(topic))
        except OnceqError as exc:
            if exc.code == ErrorCode.TOPIC_NOT_EXIST:
                return []
            raise
        return [MessageQueue(topic, i) for i in range(info.queues)]

    async def _desired(self) -> list[MessageQueue]:
        desired: list[MessageQueue] = []
        members: list[str] | None = None
        for topic in sorted(self.subscriptions):
            queues = await self._topic_queues(topic)
            if not queues:
                continue
            if not self.clustering:
                desired.extend(queues)
                continue
            if members is None:
                group: GroupMembers = await self.call(ListGroupMembers(self.group))
                members = [m["client"] for m in group.members]
                if self.client_id not in members:
                    await self.heartbeat()  # not registered (yet, or any more)
                    members.append(self.client_id)
            desired.extend(self.config.allocate(self.client_id, queues, members))
        return desired

    async def _start_offset(self, mq: MessageQueue) -> tuple[int, bool]:
        """Where to start pulling ``mq``, and whether that offset is the group's stored one."""
        stored = await self.offsets.read(mq)
        if stored is not None:
            return stored, True
        bounds: QueueOffsets = await self.call(QueryOffsets(mq.topic, mq.queue_id))
        policy = self.config.consume_from
        if mq.topic.startswith(RETRY_PREFIX) or policy == ConsumeFrom.FIRST:
            return bounds.min, False
        if policy == ConsumeFrom.LAST:
            return bounds.max, False
        ts = self.config.consume_timestamp_ms or int((time.time() - 1800) * 1000)
        found: OffsetReply = await self.call(SearchOffset(mq.topic, mq.queue_id, ts))
        return found.offset, False

    async def _take(self, mq: MessageQueue) -> None:
        while True:
            gen = self._reset_gen
            offset, stored = await self._start_offset(mq)
            if gen == self._reset_gen:
                break  # else the offsets were reset meanwhile: read the new one
        pq = ProcessQueue(mq, offset, self.clock())
        self.assignment.take(pq)
        # a start position chosen by policy (LAST, FIRST, TIMESTAMP) is not stored yet: the
        # first commit must store it, or the next owner would apply the policy again (LAST:
        # skip whatever arrived meanwhile)
        self.offsets.started(mq, offset, stored)
        self.fetcher.start(pq)

    async def _revoke(self, mq: MessageQueue) -> None:
        pq = self.assignment.get(mq)
        if pq is None:
            return
        self.assignment.revoke(pq)
        self.stats["revoked"] += 1
        await self.fetcher.stop(mq)
        await self.service.drain(pq)
        with contextlib.suppress(OnceqError):
            await self.service.release(pq)  # commit, then give the queue's lock up
        self.assignment.forget(pq)
        self.offsets.forget(mq)

    # ================================================================ offsets
    async def commit_all(self) -> None:
        for mq, pq in self.assignment.items():
            # revoked meanwhile (it committed on release; another member may own it now):
            # a late commit of the old process queue would move the offset back
            if self.assignment.active(pq):
                await self.offsets.commit(mq, pq.commit_offset)
        await self.offsets.flush()

    # ================================================================ lifecycle
    def begin(self) -> None:
        """The consumer starts (in its event loop): heartbeats and takes may run."""
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self.running = True

    def start(self) -> list[asyncio.Task[None]]:
        """Start the background loops (after the first heartbeat)."""
        loop = asyncio.get_running_loop()
        cfg = self.config
        tasks = [loop.create_task(self._rebalance_loop(), name="onceq-rebalance"),
                 loop.create_task(self._every(cfg.heartbeat_interval_s, self.heartbeat)),
                 loop.create_task(self._every(cfg.commit_interval_s, self.commit_all))]
        if self.orderly and self.clustering:
            tasks.append(loop.create_task(self._every(cfg.lock_renew_s, self.renew_locks),
                                          name="onceq-lock-renew"))
        return tasks

    async def renew_locks(self) -> None:
        """Renew the orderly queue locks (a renewal that fails: the locks age, and
        consumption stops at their maximum age)."""
        await self.service.renew()

    async def leave(self, tasks: list[asyncio.Task[None]]) -> None:
        """Stop the loops; revoke every queue (drain, commit, release); unregister."""
        self.running = False
        if self._wake is not None:
            self._wake.set()
        for t in tasks:
            t.cancel()
        # whatever ended a background task, the revoke, commit and unregister still happen
        await asyncio.gather(*tasks, *self._retakes, return_exceptions=True)
        async with self._lock:
            await asyncio.gather(*(self._revoke(mq) for mq in self.assignment),
                                 return_exceptions=True)
        await self.service.stop()
        await self.offsets.flush()
        if self.clustering:
            with contextlib.suppress(OnceqError):
                await self.call(Unregister(self.group, self.client_id), 3)

    async def _every(self, seconds: float, fn: Callable[[], Awaitable[None]]) -> None:
        while self.running:  # also ends if a cancellation was swallowed inside ``fn``
            await asyncio.sleep(seconds)
            if not self.running:
                break
            try:
                await fn()
            except OnceqError as exc:
                log.warning("%s: %s", getattr(fn, "__name__", fn), exc)
            except Exception:  # keep the loop alive: shutdown must still commit and leave
                log.exception("%s failed", getattr(fn, "__name__", fn))

    async def _rebalance_loop(self) -> None:
        assert self._wake is not None
        while self.running:
            timeout = self._timer.wait_time(self.clock())
            if timeout > 0 and not self._wake.is_set():
                await wait_event(self._wake, timeout)
            self._wake.clear()
            if not self.running:
                break
            if not self._timer.due(self.clock()):
                continue
            self._timer.done(self.clock())
            try:
                await self.rebalance()
            except OnceqError as exc:
                log.warning("rebalance of %s failed: %s", self.group, exc)
            except Exception:  # e.g. a user allocation strategy raising: try again later
                log.exception("rebalance of %s failed", self.group)
