"""Push consumer: lifecycle and wiring.

The consumer owns an :class:`~onceq.client.assignment.Assignment` (the queues it owns, each
with its process queue), pulls each owned queue with long polling, and hands what it pulls
to a consume service (concurrent or orderly, see ``consume.py``); offsets go to an offset
store (the broker for CLUSTERING, a local file for BROADCASTING, see ``offset_store.py``).
A rebalance runs every ``rebalance_interval_s`` and at once when the broker reports a
membership change. Its order lives in ``_rebalance``: revoke (stop pulling, let running
listeners finish within the drain timeout, commit, release), then take the newly assigned
queues (the orderly service first locks them on the broker).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from .._aio import wait_event
from ..log.record import RecordError, decode_records
from ..protocol.codes import RETRY_PREFIX, PullStatus, PushCode, RequestCode, retry_topic
from ..protocol.errors import ErrorCode, OnceqError
from . import middleware
from .allocation import MessageQueue
from .assignment import Assignment
from .base import BrokerClient, Connect
from .connection import BrokerConnection
from .consume import (
    ConsumeContext,
    ConsumeService,
    ConsumeStatus,
    Listener,
    ListenerThreads,
    is_orderly,
)
from .consume_concurrent import ConcurrentConsumeService
from .consume_orderly import OrderlyConsumeService
from .local_offsets import LocalOffsetStore
from .offset_store import BrokerOffsets, LocalOffsets, OffsetStore
from .process_queue import ProcessQueue
from .pull import default_client_id, parse_tags
from .push_config import ConsumeFrom, MessageModel, PushConsumerConfig
from .rebalance import RebalanceTimer, plan_rebalance

__all__ = ["ConsumeContext", "ConsumeStatus", "Listener", "PushConsumer"]

log = logging.getLogger("onceq.consumer")

_default_ids: Counter[str] = Counter()


def _unique_default_id(instance: str) -> str:
    """``host@pid#instance``, made unique inside this process: two consumers with the same
    id would be one member to the broker (each heartbeat replacing the other and notifying
    the group) and would both consume the same queues."""
    base = default_client_id(instance)
    _default_ids[base] += 1
    n = _default_ids[base]
    return base if n == 1 else f"{base}-{n}"


class PushConsumer(BrokerClient):
    def __init__(self, address: str, group: str, listener: Listener | None = None,
                 config: PushConsumerConfig | None = None, *, client_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 connect: Connect | None = None, idempotency: Any = None,
                 **overrides: Any) -> None:
        """``idempotency``: a dedup store URL, a ``DedupStore`` or an
        ``onceq.idempotency.Idempotency``: the listener runs once per dedup key (see
        docs/idempotency.md); ``idempotent_listener`` is then the guard (its ``stats``)."""
        super().__init__(address, connect)
        self.group = group
        self.config = config or PushConsumerConfig()
        for k, v in overrides.items():
            if not hasattr(self.config, k):
                raise TypeError(f"unknown consumer setting {k!r}")
            setattr(self.config, k, v)
        self.config.validate()
        self.client_id = client_id or _unique_default_id(self.config.instance_name)
        # BROADCASTING offsets file: must survive a restart, so not the default client id
        # (it holds the pid); like RocketMQ's ip@instanceName for broadcasting consumers
        self.offset_owner = client_id or f"{socket.gethostname()}#{self.config.instance_name}"
        self.clock = clock
        self._listener = listener
        self.idempotency = idempotency
        self.idempotent_listener: Any = None  # the guard around the listener (from start)
        self._subs: dict[str, str] = {}
        self.owned = Assignment()
        self.offsets: OffsetStore = BrokerOffsets(self)
        self.service: ConsumeService | None = None
        self._to_drop: set[MessageQueue] = set()  # the next rebalance drops these
        self._pull_tasks: dict[MessageQueue, asyncio.Task[None]] = {}
        self._reset_gen = 0  # the last forced offset reset handled (see offset_reset.py)
        self._hold_s: float | None = None  # the broker's access-lock hold (heartbeat answer)
        self._confirming: asyncio.Task[None] | None = None  # a heartbeat for a lapsed lease
        self._reset_tasks: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._running = False
        self._timer = RebalanceTimer(self.config.rebalance_interval_s, clock())
        self._wake: asyncio.Event | None = None
        self._threads: ListenerThreads | None = None  # for a plain listener
        self._rebalance_lock: asyncio.Lock | None = None
        self.stats: Counter[str] = Counter()

    # ================================================================ public API
    def subscribe(self, topic: str, expression: str = "*") -> None:
        """Consume ``topic``; ``expression`` is ``*`` or tags like ``TagA || TagB``."""
        self._subs[topic] = expression
        if self._running:
            self.rebalance_soon()

    def register_listener(self, listener: Listener) -> None:
        self._listener = listener

    @property
    def listener(self) -> Listener | None:
        """What consumes: the registered listener, or its idempotency guard."""
        return self.idempotent_listener or self._listener

    @property
    def clustering(self) -> bool:
        return self.config.model == MessageModel.CLUSTERING

    @property
    def orderly(self) -> bool:
        """Orderly consumption: by the ``orderly`` setting or an :func:`orderly` listener."""
        return self.config.orderly or is_orderly(self._listener)

    @property
    def assignment(self) -> list[MessageQueue]:
        return self.owned.queues()

    async def start(self) -> PushConsumer:  # type: ignore[override]
        if self._running:
            raise RuntimeError("the consumer is already started")
        if self._listener is None:
            raise ValueError("register a listener before start()")
        if not self._subs:
            raise ValueError("subscribe to a topic before start()")
        cfg = self.config
        if self.clustering:
            self._subs.setdefault(retry_topic(self.group), "*")
            self.offsets = BrokerOffsets(self)
        else:
            self.offsets = LocalOffsets(LocalOffsetStore(cfg.offset_dir, self.offset_owner,
                                                         self.group))
        self._wake = asyncio.Event()
        self._rebalance_lock = asyncio.Lock()
        self.service = (OrderlyConsumeService(self) if self.orderly
                        else ConcurrentConsumeService(self))
        if self.idempotency is not None:
            self.idempotent_listener = middleware.build("idempotency", self.idempotency
                                                        ).wrap(self._listener)
        listener = self.listener
        if not (inspect.iscoroutinefunction(listener)
                or inspect.iscoroutinefunction(type(listener).__call__)):
            self._threads = ListenerThreads(cfg.concurrency, asyncio.get_running_loop())
        self._running = True
        self._no_reconnect = False
        try:
            await self._heartbeat()
            # a listener may check its settings against the broker before consuming (the
            # idempotent wrapper checks its retention against the redelivery horizon)
            hook = getattr(listener, "on_consumer_start", None)
            if hook is not None:
                await hook(self)
        except BaseException:  # e.g. no broker: leave nothing half started behind
            self._running = False
            await self._close_guard()
            if self._conn is not None:
                self._conn.close()
            if self._threads is not None:
                self._threads.shutdown()
                self._threads = None
            raise
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._rebalance_loop(), name="onceq-rebalance"),
            loop.create_task(self._every(cfg.heartbeat_interval_s, self._heartbeat)),
            loop.create_task(self._every(cfg.commit_interval_s, self._commit_all)),
        ]
        self.service.start()
        return self

    async def __aenter__(self) -> PushConsumer:  # type: ignore[override]
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()

    async def close(self) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop pulling, let running listeners finish (bounded), commit, unregister."""
        if not self._running:
            return
        self._running = False
        self._wake.set()  # type: ignore[union-attr]
        for t in self._tasks:
            t.cancel()
        # whatever ended a background task, the revoke, commit and unregister still happen
        await asyncio.gather(*self._tasks, *self._reset_tasks, return_exceptions=True)
        async with self._rebalance_lock:  # type: ignore[union-attr]
            await asyncio.gather(*(self._revoke(mq) for mq in self.owned),
                                 return_exceptions=True)
        assert self.service is not None
        await self.service.stop()
        await self.offsets.flush()
        if self.clustering:
            with contextlib.suppress(OnceqError):
                await self._req(RequestCode.UNREGISTER, {"group": self.group,
                                                         "client": self.client_id}, timeout=3)
        self._no_reconnect = True  # late listener calls must not open a new connection
        if self._conn is not None:
            self._conn.close()
        if self._threads is not None:
            self._threads.shutdown()
        await self._close_guard()

    async def _close_guard(self) -> None:
        """Close the store the idempotency option opened (the guard keeps its stats)."""
        if self.idempotent_listener is not None:
            await self.idempotent_listener.close()

    def rebalance_soon(self) -> None:
        """Have the rebalance loop run now (not after the interval)."""
        self._timer.notify()
        if self._wake is not None:
            self._wake.set()

    # ================================================================ broker I/O
    async def _on_connected(self, conn: BrokerConnection) -> None:
        if not self._running:
            return
        # a new connection is a new member for the broker: register before any pull goes
        # out on it, or the broker would not apply the access lock. The heartbeat
        # re-asserts the queues this consumer holds (the broker may have restarted), then
        # the offsets of finished work are sent again
        header, listed = self._heartbeat_request()
        sent = self.clock()
        try:
            hdr, _ = await conn.request(RequestCode.HEARTBEAT, header)
        except OnceqError:
            return
        self._on_heartbeat_answer(hdr, listed, sent)  # resets missed while disconnected
        if self.service is not None:
            await self.service.reconnected(conn)  # orderly: lock the owned queues again
        await self.offsets.reconnected(conn, hdr.get("holds", []), self.owned.items())

    async def _req(self, code: int, header: dict[str, Any], timeout: float = 10.0
                   ) -> tuple[dict[str, Any], bytes]:
        return await self._request(code, header, timeout=timeout)

    def _on_push(self, code: int, header: dict[str, Any]) -> None:
        if code == PushCode.GROUP_CHANGED and header.get("group") == self.group:
            self.rebalance_soon()
        elif code == PushCode.OFFSETS_RESET and header.get("group") == self.group:
            self._on_reset(header)

    def _gen(self) -> dict[str, int]:
        """``reset_gen`` for requests: the broker's fence ends once it has seen it."""
        return {"reset_gen": self._reset_gen} if self._reset_gen else {}

    def _handle_resets(self, answer: dict[str, Any]) -> None:
        for notice in answer.get("resets", ()):
            if isinstance(notice, dict) and notice.get("group") == self.group:
                self._on_reset(notice)

    def _on_reset(self, notice: dict[str, Any]) -> None:
        """An admin forced the group's offsets elsewhere: drop those process queues now,
        without committing (results still to come are thrown away), and take them again
        from the broker's offset. Synchronous up to the re-take, so no request sent after
        this carries an old position without the new generation."""
        gen = notice.get("gen")
        if (not isinstance(gen, int) or gen <= self._reset_gen or not self.clustering
                or not self._running):
            return
        keys = {(t, q) for t, q in notice.get("queues", ())}
        hit = [pq for mq, pq in self.owned.items() if (mq.topic, mq.queue_id) in keys]
        self._reset_gen = gen
        self.stats["offset_resets"] += 1
        log.info("%s: offsets of group %s were reset on %d queue(s); taking %d again from "
                 "the new offsets", self.client_id, self.group, len(keys), len(hit))
        self._drop_and_retake(hit)

    def _lose(self, pqs: list[ProcessQueue], why: str) -> None:
        """The broker says these queues moved on without this member (its lock expired or
        was handed over while it was away, or the group committed past its position):
        what they hold in flight was, or will be, consumed by another member. Drop them
        now, without committing, and take them again from the group's offset."""
        lost = [pq for pq in pqs if self.owned.active(pq)]
        if not lost:
            return
        self.stats["queues_lost"] += len(lost)
        log.warning("%s: %s no longer held by this member (%s); dropping %d in-flight "
                    "message(s) and taking them again from the group's offset",
                    self.client_id, ", ".join(f"{pq.mq.topic}:{pq.mq.queue_id}"
                                              for pq in lost),
                    why, sum(len(pq) for pq in lost))
        self._drop_and_retake(lost)

    def _drop_and_retake(self, pqs: list[ProcessQueue]) -> None:
        """Stop work on ``pqs`` at once, synchronously (no request sent after this carries
        their positions), commit nothing of them (results still to come are thrown away),
        and take their queues again from the broker's offset."""
        hit = [(pq.mq, pq) for pq in pqs if self.owned.active(pq)]
        for _mq, pq in hit:
            pq.stale = True
            self.owned.revoke(pq)
            pq.released = True
        if hit:
            task = asyncio.get_running_loop().create_task(self._retake(hit))
            self._reset_tasks.add(task)
            task.add_done_callback(self._reset_tasks.discard)

    async def _retake(self, hit: list[tuple[MessageQueue, ProcessQueue]]) -> None:
        assert self.service is not None
        async with self._rebalance_lock:  # type: ignore[union-attr]
            for mq, pq in hit:
                if self.owned.get(mq) is not pq:
                    continue  # revoked meanwhile
                task = self._pull_tasks.pop(mq, None)
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                self.owned.forget(pq)
                self.service.forget(pq)
                self.offsets.forget(mq)
                if not self._running:
                    continue
                try:
                    if mq in await self.service.acquire([mq]):
                        await self._take(mq)
                except OnceqError as exc:  # the next rebalance takes it
                    log.warning("%s: could not take %s again after the reset: %s",
                                self.client_id, mq, exc)
                    self._timer.notify()

    def _heartbeat_request(self) -> tuple[dict[str, Any], dict[tuple[str, int], ProcessQueue]]:
        """A heartbeat, and the process queues its ``held`` list names."""
        meta: dict[str, Any] = {"access_lock": self.config.access_lock}
        if self.orderly:
            meta["orderly"] = True
        group: dict[str, Any] = {"group": self.group, "model": self.config.model.value,
                                 "subs": dict(self._subs), "meta": meta}
        listed: dict[tuple[str, int], ProcessQueue] = {}
        if self.clustering:  # the queues held (draining ones too, until released)
            listed = {(mq.topic, mq.queue_id): pq for mq, pq in sorted(self.owned.items())
                      if not pq.released}
            group["held"] = [[t, q, pq.next_offset] for (t, q), pq in listed.items()]
            group.update(self._gen())
        return {"client": self.client_id, "groups": [group]}, listed

    def _on_heartbeat_answer(self, hdr: dict[str, Any],
                             listed: dict[tuple[str, int], ProcessQueue], sent: float) -> None:
        """Resets to handle; per listed queue whether this member still holds it: a held
        queue's lease is renewed from ``sent``, a queue it held and holds no more is lost."""
        self._handle_resets(hdr)
        hold = hdr.get("hold_s")
        self._hold_s = float(hold) if isinstance(hold, int | float) and hold > 0 else None
        answered = {(t, q): bool(has) for g, t, q, has in hdr.get("holds", ())
                    if g == self.group}
        lost = []
        for key, pq in listed.items():
            if not self.owned.active(pq):
                continue
            if answered.get(key):
                self._confirmed(pq, sent)
            elif pq.confirmed_at is not None and self._hold_s is not None:
                lost.append(pq)  # it held the queue: not any more (or it is not there)
        self._lose(lost, "the broker gave its lock to another member or freed it")

    def _confirmed(self, pq: ProcessQueue, sent: float) -> None:
        """The broker confirmed the access lock of ``pq`` by a request sent at ``sent``."""
        if self._hold_s is not None and (pq.confirmed_at is None or sent > pq.confirmed_at):
            pq.confirmed_at = sent

    def lease_lapsed(self, pq: ProcessQueue) -> bool:
        """Whether this member has been away (paused, cut off) long enough that the broker
        may have given the queue's lock away: no confirmation for half the hold time. Its
        in-flight messages then wait for a heartbeat's answer before a listener sees them."""
        return (self._hold_s is not None and pq.confirmed_at is not None
                and self.clock() - pq.confirmed_at >= self._hold_s / 2)

    async def confirm_lease(self, pq: ProcessQueue) -> None:
        """Wait until the broker confirmed ``pq`` again (a heartbeat now) or it was dropped.
        Concurrent callers share one heartbeat."""
        delay = 0.05
        while self._running and self.owned.active(pq) and self.lease_lapsed(pq):
            if self._confirming is None or self._confirming.done():
                self._confirming = asyncio.get_running_loop().create_task(self._heartbeat())
            try:
                await asyncio.shield(self._confirming)
            except Exception as exc:  # the broker is out of reach: ask again after a wait
                log.debug("lease of %s not confirmed: %s", pq.mq, exc)
            if self.owned.active(pq) and self.lease_lapsed(pq):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _heartbeat(self) -> None:
        header, listed = self._heartbeat_request()
        sent = self.clock()
        hdr, _ = await self._req(RequestCode.HEARTBEAT, header)
        self._on_heartbeat_answer(hdr, listed, sent)

    async def _every(self, seconds: float, fn: Callable[[], Awaitable[None]]) -> None:
        while self._running:  # also ends if a cancellation was swallowed inside ``fn``
            await asyncio.sleep(seconds)
            if not self._running:
                break
            try:
                await fn()
            except OnceqError as exc:
                log.warning("%s: %s", getattr(fn, "__name__", fn), exc)
            except Exception:  # keep the loop alive: shutdown must still commit and leave
                log.exception("%s failed", getattr(fn, "__name__", fn))

    # ================================================================ rebalance
    async def _rebalance_loop(self) -> None:
        assert self._wake is not None
        while self._running:
            timeout = self._timer.wait_time(self.clock())
            if timeout > 0 and not self._wake.is_set():
                await wait_event(self._wake, timeout)
            self._wake.clear()
            if not self._running:
                break
            if not self._timer.due(self.clock()):
                continue
            self._timer.done(self.clock())
            try:
                await self._rebalance()
            except OnceqError as exc:
                log.warning("rebalance of %s failed: %s", self.group, exc)
            except Exception:  # e.g. a user allocation strategy raising: try again later
                log.exception("rebalance of %s failed", self.group)

    async def _desired(self) -> list[MessageQueue]:
        desired: list[MessageQueue] = []
        members: list[str] | None = None
        for topic in sorted(self._subs):
            try:
                hdr, _ = await self._req(RequestCode.GET_TOPIC, {"topic": topic})
            except OnceqError as exc:
                if exc.code == ErrorCode.TOPIC_NOT_EXIST:
                    continue
                raise
            queues = [MessageQueue(topic, i) for i in range(int(hdr["queues"]))]
            if not self.clustering:
                desired.extend(queues)
                continue
            if members is None:
                hdr, _ = await self._req(RequestCode.LIST_GROUP_MEMBERS, {"group": self.group})
                members = [m["client"] for m in hdr["members"]]
                if self.client_id not in members:
                    await self._heartbeat()  # not registered (yet, or any more)
                    members.append(self.client_id)
            desired.extend(self.config.allocate(self.client_id, queues, members))
        return desired

    async def _rebalance(self) -> None:
        async with self._rebalance_lock:  # type: ignore[union-attr]
            if not self._running:
                return
            desired = await self._desired()
            now = self.clock()
            stalled = [mq for mq, pq in self.owned.items()
                       if mq in self._to_drop or pq.pull_expired(now, self.config.pull_expire_s)]
            self._to_drop.clear()
            plan = plan_rebalance(self.owned, desired, stalled)
            if plan.revoke or plan.assign:
                log.info("%s rebalance: revoke %s, assign %s", self.client_id,
                         [f"{q.topic}:{q.queue_id}" for q in plan.revoke],
                         [f"{q.topic}:{q.queue_id}" for q in plan.assign])
            # 1. revoke: stop pulling, drain running listeners (bounded), commit, release
            await asyncio.gather(*(self._revoke(mq) for mq in plan.revoke))
            # 2. take the newly assigned queues
            assert self.service is not None
            granted = await self.service.acquire(plan.assign)  # orderly: broker locks
            for mq in plan.assign:
                if mq in granted:
                    await self._take(mq)

    async def _start_offset(self, mq: MessageQueue) -> tuple[int, bool]:
        """Where to start pulling ``mq``, and whether that offset is the group's stored one."""
        off = await self.offsets.read(mq)
        if off >= 0:
            return off, True
        hdr, _ = await self._req(RequestCode.QUERY_OFFSETS, {"topic": mq.topic,
                                                              "queue": mq.queue_id})
        policy = self.config.consume_from
        if mq.topic.startswith(RETRY_PREFIX) or policy == ConsumeFrom.FIRST:
            return int(hdr["min"]), False
        if policy == ConsumeFrom.LAST:
            return int(hdr["max"]), False
        ts = self.config.consume_timestamp_ms or int((time.time() - 1800) * 1000)
        hdr, _ = await self._req(RequestCode.SEARCH_OFFSET, {"topic": mq.topic,
                                                              "queue": mq.queue_id, "ts": ts})
        return int(hdr["offset"]), False

    async def _take(self, mq: MessageQueue) -> None:
        while True:
            gen = self._reset_gen
            offset, stored = await self._start_offset(mq)
            if gen == self._reset_gen:
                break  # else the offsets were reset meanwhile: read the new one
        pq = ProcessQueue(mq, offset, self.clock())
        self.owned.take(pq)
        # a start position chosen by policy (LAST, FIRST, TIMESTAMP) is not stored yet: the
        # first commit must store it, or the next owner would apply the policy again (LAST:
        # skip whatever arrived meanwhile)
        self.offsets.started(mq, offset, stored)
        self._pull_tasks[mq] = asyncio.get_running_loop().create_task(
            self._pull_loop(pq), name=f"onceq-pull-{mq.topic}-{mq.queue_id}")

    async def _revoke(self, mq: MessageQueue) -> None:
        pq = self.owned.get(mq)
        if pq is None:
            return
        assert self.service is not None
        self.owned.revoke(pq)
        self.stats["revoked"] += 1
        task = self._pull_tasks.pop(mq, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.service.drain(pq)
        with contextlib.suppress(OnceqError):
            await self.service.release(pq)  # commit, then give the queue's lock up
        self.owned.forget(pq)
        self.offsets.forget(mq)

    # ================================================================ offsets
    async def _commit_all(self) -> None:
        for mq, pq in self.owned.items():
            # revoked meanwhile (it committed on release; another member may own it now):
            # a late commit of the old process queue would move the offset back
            if self.owned.active(pq):
                await self.offsets.commit(mq, pq.commit_offset)
        await self.offsets.flush()

    # ================================================================ pulling
    async def _pull_loop(self, pq: ProcessQueue) -> None:
        cfg = self.config
        mq = pq.mq
        service = self.service
        assert service is not None
        tags = parse_tags(self._subs.get(mq.topic, "*"))
        wanted = set(tags) if tags else None
        failures = 0
        while self.owned.active(pq):
            if pq.flow_blocked(cfg.flow_count, cfg.flow_bytes, cfg.flow_span):
                pq.last_pull = self.clock()  # alive, just throttled
                self.stats["flow_paused"] += 1
                await asyncio.sleep(cfg.flow_pause_s)
                continue
            if not service.may_pull(pq):  # orderly: the queue's lock is being renewed
                pq.last_pull = self.clock()
                await asyncio.sleep(cfg.locked_backoff_s)
                continue
            if self.lease_lapsed(pq):  # away (paused): is the queue still ours?
                await self.confirm_lease(pq)
                continue
            header: dict[str, Any] = {
                "topic": mq.topic, "queue": mq.queue_id, "offset": pq.next_offset,
                "max": cfg.pull_batch_size, "group": self.group, "client": self.client_id,
                "suspend_ms": int(cfg.pull_suspend_s * 1000),
            }
            if tags:
                header["tags"] = tags
            header.update(self._gen())
            commit = self.offsets.piggyback(mq, pq.commit_offset)
            if commit is not None:
                header["commit"] = commit
            sent = self.clock()
            try:
                hdr, payload = await self._req(RequestCode.PULL, header,
                                               timeout=cfg.pull_suspend_s + 10)
            except OnceqError as exc:
                if exc.code in (ErrorCode.TOPIC_NOT_EXIST, ErrorCode.INVALID_QUEUE):
                    # the topic was deleted (maybe re-created, offsets from 0 again): the
                    # next rebalance drops this queue and takes it afresh if it exists
                    log.warning("pull %s: %s; queue dropped until the next rebalance", mq,
                                exc.message)
                    self._to_drop.add(mq)
                    self.rebalance_soon()
                    return
                failures += 1
                log.debug("pull %s failed: %s", mq, exc)
                await asyncio.sleep(min(0.05 * 2 ** failures, 3.0))
                continue
            failures = 0
            pq.last_pull = self.clock()
            status = hdr["st"]
            if status == PullStatus.LOCKED:
                if pq.confirmed_at is not None:  # it held the queue: another holds it now
                    self._lose([pq], "another member holds its lock")
                    break
            elif "behind" in hdr:  # its commit was below the group's: the group moved on
                self._lose([pq], f"the group committed {hdr['behind']}, past its "
                                 f"position {commit}")
                break
            else:
                self._confirmed(pq, sent)
                if commit is not None:  # a refused pull's commit was not applied: sent
                    self.offsets.carried(mq, commit)  # again
            if status == PullStatus.FOUND:
                try:
                    msgs = list(decode_records(payload)) if payload else []
                except RecordError as exc:  # damaged in transit: pull the same range again
                    log.warning("pull %s at %d: %s; pulling again", mq, pq.next_offset, exc)
                    await asyncio.sleep(cfg.locked_backoff_s)
                    continue
                if wanted is not None:
                    msgs = [m for m in msgs if m.tags in wanted]
                if not self.owned.active(pq):
                    break
                pq.add(msgs)
                pq.next_offset = hdr["next"]
                service.dispatch(pq, msgs)
            elif status == PullStatus.LOCKED:
                # the previous owner is still draining this queue: retry shortly
                self.stats["locked"] += 1
                await asyncio.sleep(cfg.locked_backoff_s)
            elif hdr["next"] < pq.next_offset:
                # the broker moved us back (the queue ends below what we pulled): continue
                # there once nothing is in flight, and commit the corrected offset
                if len(pq):
                    await asyncio.sleep(cfg.flow_pause_s)
                    continue
                log.warning("pull %s at %d: %s, continuing at %d", mq, pq.next_offset,
                            PullStatus(status).name, hdr["next"])
                pq.rewind(hdr["next"])
                self.offsets.moved_back(mq)  # let the next pull commit the lower offset
            else:
                if status != PullStatus.NO_NEW_MESSAGE:
                    log.warning("pull %s at %d: %s, continuing at %d", mq, pq.next_offset,
                                PullStatus(status).name, hdr["next"])
                pq.next_offset = hdr["next"]
