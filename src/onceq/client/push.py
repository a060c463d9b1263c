"""Push consumer: rebalance, process queues, concurrent consumption, retries.

Pulls run per owned queue with long polling; listener calls run concurrently (bounded);
the committed offset of a queue is its lowest in-flight offset. A rebalance runs every
``rebalance_interval_s`` and at once when the broker reports a membership change. Its order
lives in ``_rebalance``: revoke (stop pulling, let running listeners finish within the drain
timeout, commit, release), then take the newly assigned queues.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .._aio import wait_event
from ..log.record import Message as MessageExt
from ..log.record import RecordError, decode_records
from ..protocol.codes import (
    PROP_ORIGIN_TOPIC,
    RETRY_PREFIX,
    PullStatus,
    PushCode,
    RequestCode,
    retry_topic,
)
from ..protocol.errors import ErrorCode, OnceqError
from .allocation import MessageQueue
from .connection import BrokerConnection, ConnectionLost
from .local_offsets import LocalOffsetStore
from .process_queue import ProcessQueue
from .pull import default_client_id, parse_tags
from .push_config import ConsumeFrom, MessageModel, PushConsumerConfig
from .rebalance import RebalanceTimer, plan_rebalance

log = logging.getLogger("onceq.consumer")


class ConsumeStatus(StrEnum):
    SUCCESS = "SUCCESS"
    RECONSUME_LATER = "RECONSUME_LATER"


@dataclass(slots=True)
class ConsumeContext:
    """Passed to the listener with each batch.

    ``ack_index``: with SUCCESS, messages after this index are retried (partial success);
    the default covers the whole batch. ``delay_level``: 0 lets the broker choose
    (3 + reconsume count), -1 sends the retried messages straight to the group's DLQ; a
    listener may set another level for its retries. ``group``: the consumer group.
    """

    queue: MessageQueue
    ack_index: int
    delay_level: int = 0
    group: str = ""


Listener = Callable[[list[MessageExt], ConsumeContext],
                    Awaitable[ConsumeStatus | None] | ConsumeStatus | None]


# opens a connection to ``address`` that hands server pushes to the callback
Connect = Callable[[str, Callable[[int, dict[str, Any]], None]], Awaitable[BrokerConnection]]

_default_ids: Counter[str] = Counter()


def _unique_default_id(instance: str) -> str:
    """``host@pid#instance``, made unique inside this process: two consumers with the same
    id would be one member to the broker (each heartbeat replacing the other and notifying
    the group) and would both consume the same queues."""
    base = default_client_id(instance)
    _default_ids[base] += 1
    n = _default_ids[base]
    return base if n == 1 else f"{base}-{n}"


class PushConsumer:
    def __init__(self, address: str, group: str, listener: Listener | None = None,
                 config: PushConsumerConfig | None = None, *, client_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 connect: Connect = BrokerConnection.open, **overrides: Any) -> None:
        self.address = address
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
        self._connect = connect  # how to open a broker connection (an in-memory one in tests)
        self._listener = listener
        self._subs: dict[str, str] = {}
        self._conn: BrokerConnection | None = None
        self._pqs: dict[MessageQueue, ProcessQueue] = {}
        self._stale: set[MessageQueue] = set()  # queues whose topic went away under a pull
        self._pull_tasks: dict[MessageQueue, asyncio.Task[None]] = {}
        self._inflight: dict[MessageQueue, set[asyncio.Task[None]]] = {}
        self._committed: dict[MessageQueue, int] = {}
        self._refused: dict[MessageQueue, int] = {}  # a commit refused with NOT_HOLDER
        self._reset_gen = 0  # the last forced offset reset handled (see offset_reset.py)
        self._reset_tasks: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._running = False
        self._timer = RebalanceTimer(self.config.rebalance_interval_s, clock())
        self._wake: asyncio.Event | None = None
        self._sem: asyncio.Semaphore | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._rebalance_lock: asyncio.Lock | None = None
        self._connect_lock: asyncio.Lock | None = None
        self._closed = False  # after shutdown: no new connections (late listener calls)
        self._local: LocalOffsetStore | None = None
        self.stats: Counter[str] = Counter()

    # ================================================================ public API
    def subscribe(self, topic: str, expression: str = "*") -> None:
        """Consume ``topic``; ``expression`` is ``*`` or tags like ``TagA || TagB``."""
        self._subs[topic] = expression
        if self._running:
            self._timer.notify()
            self._wake.set()  # type: ignore[union-attr]

    def register_listener(self, listener: Listener) -> None:
        self._listener = listener

    @property
    def clustering(self) -> bool:
        return self.config.model == MessageModel.CLUSTERING

    @property
    def assignment(self) -> list[MessageQueue]:
        return sorted(self._pqs)

    async def start(self) -> PushConsumer:
        if self._running:
            raise RuntimeError("the consumer is already started")
        if self._listener is None:
            raise ValueError("register a listener before start()")
        if not self._subs:
            raise ValueError("subscribe to a topic before start()")
        cfg = self.config
        if self.clustering:
            self._subs.setdefault(retry_topic(self.group), "*")
        else:
            self._local = LocalOffsetStore(cfg.offset_dir, self.offset_owner, self.group)
        self._wake = asyncio.Event()
        self._sem = asyncio.Semaphore(cfg.concurrency)
        self._rebalance_lock = asyncio.Lock()
        listener = self._listener
        if not (inspect.iscoroutinefunction(listener)
                or inspect.iscoroutinefunction(type(listener).__call__)):
            self._executor = ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="onceq-consume")
        self._running = True
        self._closed = False
        try:
            await self._heartbeat()
            # a listener may check its settings against the broker before consuming (the
            # idempotent wrapper checks its retention against the redelivery horizon)
            hook = getattr(listener, "on_consumer_start", None)
            if hook is not None:
                await hook(self)
        except BaseException:  # e.g. no broker: leave nothing half started behind
            self._running = False
            if self._conn is not None:
                self._conn.close()
            if self._executor is not None:
                self._executor.shutdown(wait=False)
                self._executor = None
            raise
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._rebalance_loop(), name="onceq-rebalance"),
            loop.create_task(self._every(cfg.heartbeat_interval_s, self._heartbeat)),
            loop.create_task(self._every(cfg.commit_interval_s, self._commit_all)),
        ]
        return self

    async def __aenter__(self) -> PushConsumer:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
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
            await asyncio.gather(*(self._revoke(mq) for mq in list(self._pqs)),
                                 return_exceptions=True)
        if self._local is not None:
            self._local.save()
        if self.clustering:
            with contextlib.suppress(OnceqError):
                await self._req(RequestCode.UNREGISTER, {"group": self.group,
                                                         "client": self.client_id}, timeout=3)
        self._closed = True
        if self._conn is not None:
            self._conn.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # ================================================================ broker I/O
    async def _connection(self) -> BrokerConnection:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        if self._closed:
            raise ConnectionLost("the consumer is shut down")
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        # one connection at a time: every pull loop notices a lost connection at once, and
        # without the lock each opened its own (all but one leaked, never closed)
        async with self._connect_lock:
            if self._conn is None or self._conn.closed:
                conn = await self._connect(self.address, self._on_push)
                if self._running:
                    # a new connection is a new member for the broker: register before any
                    # pull goes out on it, or the broker would not apply the access lock.
                    # The heartbeat re-asserts the queues this consumer holds (the broker
                    # may have restarted), then the offsets of finished work are sent again
                    try:
                        hdr, _ = await conn.request(RequestCode.HEARTBEAT,
                                                    self._heartbeat_header())
                    except OnceqError:
                        pass
                    else:
                        self._handle_resets(hdr)  # missed while disconnected
                        await self._resend_offsets(conn, hdr.get("holds", []))
                self._conn = conn
            return self._conn

    async def _resend_offsets(self, conn: BrokerConnection, holds: list[list[Any]]) -> None:
        """After a reconnect: commit again the offsets of work finished on held queues.

        A restarted broker may have lost commits made since its last offsets snapshot; the
        process queues kept across the reconnect know them. Only queues this consumer still
        holds (the heartbeat answer says so when the access lock applies), and never moving
        an offset backwards (the stored one is read first).
        """
        if self._local is not None:
            return
        refused = {(t, q) for g, t, q, h in holds if g == self.group and not h}
        todo = [(mq, pq.ack_offset) for mq, pq in self._pqs.items()
                if not pq.released and pq.ack_offset >= 0
                and (mq.topic, mq.queue_id) not in refused]

        async def one(mq: MessageQueue, ack: int) -> None:
            q = {"group": self.group, "topic": mq.topic, "queue": mq.queue_id}
            hdr, _ = await conn.request(RequestCode.GET_OFFSET, q)
            stored = int(hdr["offset"])
            if ack <= stored:
                self._committed[mq] = max(self._committed.get(mq, -1), stored)
                return
            # NOT_HOLDER (another member holds it now) lands below: the next pull commits
            await conn.request(RequestCode.COMMIT_OFFSET, {
                **q, "offset": ack, "client": self.client_id, **self._gen()})
            self._committed[mq] = ack
            self.stats["offsets_resent"] += 1

        results = await asyncio.gather(*(one(mq, ack) for mq, ack in todo),
                                       return_exceptions=True)
        for (mq, _ack), res in zip(todo, results, strict=True):
            if isinstance(res, OnceqError):
                log.debug("offset of %s not sent again: %s", mq, res)
                self._committed[mq] = -1  # the next pull commits it
            elif isinstance(res, BaseException):
                raise res

    async def _req(self, code: int, header: dict[str, Any], timeout: float = 10.0
                   ) -> tuple[dict[str, Any], bytes]:
        conn = await self._connection()
        return await conn.request(code, header, timeout=timeout)

    def _on_push(self, code: int, header: dict[str, Any]) -> None:
        if code == PushCode.GROUP_CHANGED and header.get("group") == self.group:
            self._timer.notify()
            if self._wake is not None:
                self._wake.set()
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
        if (not isinstance(gen, int) or gen <= self._reset_gen or self._local is not None
                or not self._running):
            return
        keys = {(t, q) for t, q in notice.get("queues", ())}
        hit = [(mq, pq) for mq, pq in self._pqs.items() if (mq.topic, mq.queue_id) in keys]
        for _mq, pq in hit:
            pq.dropped = pq.released = pq.reset = True
        self._reset_gen = gen
        self.stats["offset_resets"] += 1
        log.info("%s: offsets of group %s were reset on %d queue(s); taking %d again from "
                 "the new offsets", self.client_id, self.group, len(keys), len(hit))
        if hit:
            task = asyncio.get_running_loop().create_task(self._retake(hit))
            self._reset_tasks.add(task)
            task.add_done_callback(self._reset_tasks.discard)

    async def _retake(self, hit: list[tuple[MessageQueue, ProcessQueue]]) -> None:
        async with self._rebalance_lock:  # type: ignore[union-attr]
            for mq, pq in hit:
                if self._pqs.get(mq) is not pq:
                    continue  # revoked meanwhile
                task = self._pull_tasks.pop(mq, None)
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                self._pqs.pop(mq, None)
                self._inflight.pop(mq, None)
                self._committed.pop(mq, None)
                self._refused.pop(mq, None)
                if not self._running:
                    continue
                try:
                    await self._take(mq)
                except OnceqError as exc:  # the next rebalance takes it
                    log.warning("%s: could not take %s again after the reset: %s",
                                self.client_id, mq, exc)
                    self._pqs.pop(mq, None)
                    self._timer.notify()

    def _heartbeat_header(self) -> dict[str, Any]:
        group: dict[str, Any] = {"group": self.group, "model": self.config.model.value,
                                 "subs": dict(self._subs),
                                 "meta": {"access_lock": self.config.access_lock}}
        if self.clustering:  # the queues held (draining ones too, until released)
            group["held"] = [[mq.topic, mq.queue_id, pq.next_offset]
                             for mq, pq in sorted(self._pqs.items()) if not pq.released]
            group.update(self._gen())
        return {"client": self.client_id, "groups": [group]}

    async def _heartbeat(self) -> None:
        hdr, _ = await self._req(RequestCode.HEARTBEAT, self._heartbeat_header())
        self._handle_resets(hdr)

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
            stalled = [mq for mq, pq in self._pqs.items()
                       if mq in self._stale or pq.pull_expired(now, self.config.pull_expire_s)]
            self._stale.clear()
            plan = plan_rebalance(self._pqs, desired, stalled)
            if plan.revoke or plan.assign:
                log.info("%s rebalance: revoke %s, assign %s", self.client_id,
                         [f"{q.topic}:{q.queue_id}" for q in plan.revoke],
                         [f"{q.topic}:{q.queue_id}" for q in plan.assign])
            # 1. revoke: stop pulling, drain running listeners (bounded), commit, release
            await asyncio.gather(*(self._revoke(mq) for mq in plan.revoke))
            # 2. take the newly assigned queues
            for mq in plan.assign:
                await self._take(mq)

    async def _start_offset(self, mq: MessageQueue) -> tuple[int, bool]:
        """Where to start pulling ``mq``, and whether that offset is the group's stored one."""
        if self._local is not None:
            off = self._local.get(mq)
        else:
            hdr, _ = await self._req(RequestCode.GET_OFFSET, {"group": self.group,
                                                              "topic": mq.topic,
                                                              "queue": mq.queue_id})
            off = int(hdr["offset"])
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
        self._pqs[mq] = pq
        # a start position chosen by policy (LAST, FIRST, TIMESTAMP) is not stored yet: the
        # first commit must store it, or the next owner would apply the policy again (LAST:
        # skip whatever arrived meanwhile)
        self._committed[mq] = offset if stored else -1
        self._inflight[mq] = set()
        self._pull_tasks[mq] = asyncio.get_running_loop().create_task(
            self._pull_loop(pq), name=f"onceq-pull-{mq.topic}-{mq.queue_id}")

    async def _revoke(self, mq: MessageQueue) -> None:
        pq = self._pqs.get(mq)
        if pq is None:
            return
        pq.dropped = True
        self.stats["revoked"] += 1
        task = self._pull_tasks.pop(mq, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        running = self._inflight.get(mq, set())
        if running:
            _, pending = await asyncio.wait(running, timeout=self.config.drain_timeout_s)
            if pending:
                log.warning("%s: %d listener call(s) on %s still running after the drain "
                            "timeout; their messages will be redelivered", self.client_id,
                            len(pending), mq)
        with contextlib.suppress(OnceqError):
            if self._local is None:  # commit, then give the access lock up: no wait for
                await self._req(RequestCode.RELEASE_QUEUE, {  # the next owner
                    "group": self.group, "client": self.client_id, "topic": mq.topic,
                    "queue": mq.queue_id, "offset": -1 if pq.reset else pq.ack_offset,
                    **self._gen()})
            else:
                await self._commit(mq, pq.ack_offset)
        pq.released = True
        self._pqs.pop(mq, None)
        self._inflight.pop(mq, None)
        self._committed.pop(mq, None)
        self._refused.pop(mq, None)

    # ================================================================ offsets
    async def _commit(self, mq: MessageQueue, offset: int) -> None:
        if offset <= self._committed.get(mq, -1) or self._refused.get(mq) == offset:
            return
        if self._local is not None:
            self._local.set(mq, offset)
        else:
            try:
                await self._req(RequestCode.COMMIT_OFFSET, {
                    "group": self.group, "topic": mq.topic, "queue": mq.queue_id,
                    "offset": offset, "client": self.client_id, **self._gen()})
            except OnceqError as exc:
                if exc.code != ErrorCode.NOT_HOLDER:
                    raise
                # this member lost the queue's access lock (a rebalance or an offset reset
                # is under way): not an error, and not worth repeating. A pull that gets
                # the lock back carries the commit; otherwise the rebalance drops the queue
                log.debug("commit of %s refused: %s", mq, exc.message)
                self._refused[mq] = offset
                self.stats["commits_refused"] += 1
                return
        self._committed[mq] = offset

    async def _commit_all(self) -> None:
        for mq, pq in list(self._pqs.items()):
            # revoked meanwhile (it committed on release; another member may own it now):
            # a late commit of the old process queue would move the offset back
            if not pq.dropped and self._pqs.get(mq) is pq:
                await self._commit(mq, pq.ack_offset)
        if self._local is not None:
            self._local.save()

    # ================================================================ pulling
    async def _pull_loop(self, pq: ProcessQueue) -> None:
        cfg = self.config
        mq = pq.mq
        tags = parse_tags(self._subs.get(mq.topic, "*"))
        wanted = set(tags) if tags else None
        failures = 0
        while not pq.dropped:
            if pq.flow_blocked(cfg.flow_count, cfg.flow_bytes, cfg.flow_span):
                pq.last_pull = self.clock()  # alive, just throttled
                self.stats["flow_paused"] += 1
                await asyncio.sleep(cfg.flow_pause_s)
                continue
            header: dict[str, Any] = {
                "topic": mq.topic, "queue": mq.queue_id, "offset": pq.next_offset,
                "max": cfg.pull_batch_size, "group": self.group, "client": self.client_id,
                "suspend_ms": int(cfg.pull_suspend_s * 1000),
            }
            if tags:
                header["tags"] = tags
            header.update(self._gen())
            commit = pq.ack_offset
            if self._local is None and commit > self._committed.get(mq, -1):
                header["commit"] = commit
            try:
                hdr, payload = await self._req(RequestCode.PULL, header,
                                               timeout=cfg.pull_suspend_s + 10)
            except OnceqError as exc:
                if exc.code in (ErrorCode.TOPIC_NOT_EXIST, ErrorCode.INVALID_QUEUE):
                    # the topic was deleted (maybe re-created, offsets from 0 again): the
                    # next rebalance drops this queue and takes it afresh if it exists
                    log.warning("pull %s: %s; queue dropped until the next rebalance", mq,
                                exc.message)
                    self._stale.add(mq)
                    self._timer.notify()
                    self._wake.set()  # type: ignore[union-attr]
                    return
                failures += 1
                log.debug("pull %s failed: %s", mq, exc)
                await asyncio.sleep(min(0.05 * 2 ** failures, 3.0))
                continue
            failures = 0
            pq.last_pull = self.clock()
            status = hdr["st"]
            if "commit" in header and status != PullStatus.LOCKED:  # a refused pull's
                # commit was not applied: it must be sent again
                self._committed[mq] = max(self._committed.get(mq, -1), header["commit"])
            if status == PullStatus.FOUND:
                try:
                    msgs = list(decode_records(payload)) if payload else []
                except RecordError as exc:  # damaged in transit: pull the same range again
                    log.warning("pull %s at %d: %s; pulling again", mq, pq.next_offset, exc)
                    await asyncio.sleep(cfg.locked_backoff_s)
                    continue
                if wanted is not None:
                    msgs = [m for m in msgs if m.tags in wanted]
                if pq.dropped:
                    break
                pq.add(msgs)
                pq.next_offset = hdr["next"]
                self._dispatch(pq, msgs)
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
                self._committed[mq] = -1  # let the next pull commit the lower offset
            else:
                if status != PullStatus.NO_NEW_MESSAGE:
                    log.warning("pull %s at %d: %s, continuing at %d", mq, pq.next_offset,
                                PullStatus(status).name, hdr["next"])
                pq.next_offset = hdr["next"]

    # ================================================================ consuming
    def _dispatch(self, pq: ProcessQueue, msgs: list[MessageExt]) -> None:
        if pq.dropped:
            return
        size = self.config.batch_size
        running = self._inflight[pq.mq]
        loop = asyncio.get_running_loop()
        for i in range(0, len(msgs), size):
            t = loop.create_task(self._consume(pq, msgs[i:i + size]))
            running.add(t)
            t.add_done_callback(running.discard)

    async def _consume(self, pq: ProcessQueue, batch: list[MessageExt]) -> None:
        assert self._sem is not None
        async with self._sem:
            if pq.dropped:
                return  # not started before the revoke: the next owner gets it
            for m in batch:
                origin = m.properties.get(PROP_ORIGIN_TOPIC)
                if origin is not None and m.topic.startswith(RETRY_PREFIX):
                    m.topic = origin
            ctx = ConsumeContext(pq.mq, len(batch) - 1, group=self.group)
            status = await self._call_listener(batch, ctx)
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
        self.stats["consumed"] += len(done)
        if failed:
            self.stats["failed"] += len(failed)
            done += await self._send_back(pq, failed, ctx.delay_level)
        pq.remove(done)

    async def _call_listener(self, batch: list[MessageExt], ctx: ConsumeContext
                             ) -> ConsumeStatus:
        timeout = self.config.consume_timeout_s
        try:
            if self._executor is None:
                result = await asyncio.wait_for(self._listener(batch, ctx), timeout)  # type: ignore[misc]
            else:
                loop = asyncio.get_running_loop()
                result = await asyncio.wait_for(
                    loop.run_in_executor(self._executor, self._listener, batch, ctx), timeout)
            if inspect.isawaitable(result):  # e.g. an object with an async __call__
                result = await asyncio.wait_for(result, timeout)
            return ConsumeStatus.SUCCESS if result is None else ConsumeStatus(result)
        except TimeoutError:
            log.warning("listener exceeded the consume timeout of %.0fs on %s; retrying",
                        timeout, ctx.queue)
            return ConsumeStatus.RECONSUME_LATER
        except Exception:
            # includes a result that is no ConsumeStatus: before, that escaped and left the
            # batch in flight forever, holding the queue's commit offset back
            log.exception("listener failed on %s; retrying the batch", ctx.queue)
            return ConsumeStatus.RECONSUME_LATER

    async def _send_back(self, pq: ProcessQueue, failed: list[MessageExt], delay_level: int
                         ) -> list[MessageExt]:
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
                await self._req(RequestCode.CONSUMER_SEND_BACK, {
                    "group": self.group, "topic": pq.mq.topic, "queue": pq.mq.queue_id,
                    "offset": m.queue_offset, "delay_level": delay_level,
                    "max_reconsume": self.config.max_reconsume,
                })
                taken.append(m)
                self.stats["sent_back"] += 1
            except OnceqError as exc:
                log.warning("send back of %s@%d failed (%s); retrying locally", pq.mq,
                            m.queue_offset, exc)
                later.append(m)
        if later and not pq.dropped:
            loop = asyncio.get_running_loop()
            loop.call_later(self.config.send_back_retry_s, self._dispatch, pq, later)
        return taken
