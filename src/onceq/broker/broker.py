"""The onceq broker: request handlers over the message store, on one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import Callable
from typing import Any

from ..log.offset_record import OFFSETS_TOPIC
from ..log.record import tag_hash
from ..protocol.codes import PullStatus, PushCode, RequestCode
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.frame import REQUEST, decode_header, max_frame_for_body
from ..storage.failures import storage_error
from ..storage.files import OS_FILES, FileOps
from ..storage.sequences import SequenceStore
from ..storage.store import MessageStore, check_name
from .admin_ops import AdminOps
from .config import BrokerConfig
from .connection import Connection
from .flush import Flusher
from .groups import BROADCASTING, CLUSTERING, GroupRegistry
from .idempotent import refuse_sequenced, send_sequenced
from .limits import ConnectionGuard
from .longpoll import HeldPull, PullHold
from .metrics import BrokerMetrics, start_metrics
from .offset_reset import FENCE_MAX_AGE_S, ResetFence, parse_targets, reset_offsets
from .queue_lock import QueueLocks
from .retry import RetryService, parse_delay_levels
from .trace import DeliveryTrace
from .transition import TransitionLock

log = logging.getLogger("onceq.broker")

_U32 = struct.Struct("<I")
Response = tuple[int, dict[str, Any] | None, bytes] | None


def split_parts(payload: bytes) -> list[memoryview]:
    """Split a batch payload of [u32 length][part] items."""
    view = memoryview(payload)
    parts = []
    pos = 0
    n = len(view)
    while pos < n:
        if n - pos < 4:
            raise OnceqError(ErrorCode.BAD_REQUEST, "truncated message length in batch")
        size = _U32.unpack_from(view, pos)[0]
        pos += 4
        if size > n - pos:
            raise OnceqError(ErrorCode.BAD_REQUEST, "message length exceeds the batch")
        parts.append(view[pos:pos + size])
        pos += size
    if not parts:
        raise OnceqError(ErrorCode.BAD_REQUEST, "empty batch")
    return parts


def _int(header: dict[str, Any], name: str, default: int | None = None) -> int:
    value = header.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise OnceqError(ErrorCode.INVALID_ARGUMENT, f"field {name!r} must be an integer")
    return value


def _str(header: dict[str, Any], name: str) -> str:
    value = header.get(name)
    if not isinstance(value, str):
        raise OnceqError(ErrorCode.INVALID_ARGUMENT, f"field {name!r} must be a string")
    return value


def _user_topic(topic: str) -> str:
    """Refuse the broker's internal offsets journal topic in user requests."""
    if topic == OFFSETS_TOPIC:
        raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                         f"topic {OFFSETS_TOPIC} is internal to the broker (the consumer "
                         "offsets journal): it cannot be sent to, pulled, created or deleted")
    return topic


def _held(group: dict[str, Any]) -> list[tuple[str, int, int]] | None:
    """The ``held`` field of a heartbeat's group: [[topic, queue, next offset], ...]."""
    held = group.get("held")
    if held is None:
        return None
    if not isinstance(held, list) or not all(
            isinstance(x, list) and len(x) == 3 and isinstance(x[0], str)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in x[1:])
            for x in held):
        raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                         "held must be a list of [topic, queue, next offset]")
    return [(t, q, d) for t, q, d in held]


def _answer_durable(conn: Connection, corr: int, header: dict[str, Any],
                    fut: asyncio.Future[None]) -> None:
    """Answer a sync-flush send once its fsync is done (or failed)."""
    exc = None if fut.cancelled() else fut.exception()
    if fut.cancelled() or exc is not None:
        err = exc if isinstance(exc, OnceqError) else OnceqError(ErrorCode.FLUSH_TIMEOUT)
        conn.respond(corr, int(err.code), {"message": err.message})
    else:
        conn.respond(corr, 0, header)


class Broker:
    def __init__(self, config: BrokerConfig, clock: Callable[[], float] = time.time,
                 files: FileOps = OS_FILES) -> None:
        config.validate()
        self.config = config
        self.clock = clock
        self.store = MessageStore(config.store, clock, files)
        self.sequences = SequenceStore(self.store, config.writer_expiry_s)  # idempotent writers
        self.connections: set[Connection] = set()
        self.guard = ConnectionGuard(config.max_connections, config.fd_reserve,
                                     config.read_timeout_s, config.idle_timeout_s,
                                     max_input=config.input_budget(),
                                     headroom=self._open_files_headroom)
        self.groups = GroupRegistry(config.heartbeat_expiry_s, self._on_group_change)
        self.holds = PullHold(self._retry_pull)
        self.fence = ResetFence()  # members that have not seen a forced offset reset yet
        self.transition = TransitionLock(
            self.store, self.groups, config.access_lock, config.access_lock_hold_s,
            config.access_lock_stable_checks, clock, config.access_lock_restore_hold_s, files,
            self._locks_changed)
        self.queue_locks = QueueLocks(self)  # orderly consumption (queue_lock.py)
        self._locks_dirty: asyncio.Event | None = None
        self._started = clock()
        self._hold_timer: asyncio.TimerHandle | None = None
        self.flusher: Flusher | None = None
        self.retry: RetryService | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._io: set[asyncio.Future[Any]] = set()
        self._offsets_lock = asyncio.Lock()  # one offsets snapshot write at a time
        self._closing = False
        self.port = config.port
        self.metrics: BrokerMetrics | None = None  # counters, when metrics_port is set
        self.handlers: dict[int, Callable[[Connection, int, dict[str, Any], bytes], Response]] = {
            RequestCode.PING: self.h_ping,
            RequestCode.SEND: self.h_send,
            RequestCode.SEND_BATCH: self.h_send,
            RequestCode.SEND_SEQUENCED: self.h_send_sequenced,
            RequestCode.PULL: self.h_pull,
            RequestCode.QUERY_OFFSETS: self.h_query_offsets,
            RequestCode.SEARCH_OFFSET: self.h_search_offset,
            RequestCode.COMMIT_OFFSET: self.h_commit_offset,
            RequestCode.GET_OFFSET: self.h_get_offset,
            RequestCode.CREATE_TOPIC: self.h_create_topic,
            RequestCode.DELETE_TOPIC: self.h_delete_topic,
            RequestCode.LIST_TOPICS: self.h_list_topics,
            RequestCode.GET_TOPIC: self.h_get_topic,
            RequestCode.HEARTBEAT: self.h_heartbeat,
            RequestCode.UNREGISTER: self.h_unregister,
            RequestCode.LIST_GROUP_MEMBERS: self.h_list_members,
            RequestCode.LIST_GROUPS: self.h_list_groups,
            RequestCode.CONSUMER_SEND_BACK: self.h_send_back,
            RequestCode.RELEASE_QUEUE: self.h_release_queue,
            RequestCode.RESET_OFFSETS: self.h_reset_offsets,
            RequestCode.QUERY_ACCESS_LOCKS: self.h_query_access_locks,
            RequestCode.BROKER_STATUS: self.h_broker_status,
            RequestCode.LOCK_QUEUES: self.queue_locks.h_lock,
            RequestCode.UNLOCK_QUEUES: self.queue_locks.h_unlock,
        }
        self.trace = DeliveryTrace(self.store, clock, self._on_internal_put)
        self.handlers.update(AdminOps(self).handlers())

    # ================================================================ lifecycle
    async def start(self) -> None:
        t0 = time.perf_counter()
        self.store.open()
        log.info("store opened in %.2fs (%d records)", time.perf_counter() - t0,
                 self.store.recovered_records)
        self.sequences.open()
        self._started = self.clock()
        self.trace.load()
        if self.transition.load():  # when the restore hold ends, the groups rebalance
            self._hold_timer = asyncio.get_running_loop().call_later(
                self.config.access_lock_restore_hold_s, self._restore_hold_ended)
        self._locks_dirty = asyncio.Event()
        cfg = self.config
        self.retry = RetryService(self.store, parse_delay_levels(cfg.delay_levels), self.clock,
                                  self._on_internal_put)
        self.retry.start()
        self.flusher = Flusher(self.store, cfg.store.flush, cfg.store.flush_interval_ms)
        self.flusher.start()
        loop = asyncio.get_running_loop()
        max_frame = max_frame_for_body(cfg.store.max_body)
        self.guard.measure(0)
        try:
            self._server = await loop.create_server(
                lambda: Connection(self, max_frame, cfg.max_output_bytes), cfg.host, cfg.port,
                reuse_address=True)
        except BaseException:  # e.g. port in use: leave no flusher task nor open store
            await self.retry.stop()
            await self.flusher.stop()
            self.store.close()
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        self._tasks = [
            loop.create_task(self._every(cfg.store.checkpoint_interval_ms / 1000,
                                         self._checkpoint)),
            loop.create_task(self._every(cfg.offsets_save_s, self._save_offsets)),
            loop.create_task(self._every(cfg.offsets_save_s, self._save_sequences)),
            loop.create_task(self._every(cfg.offsets_journal_ms / 1000,
                                         self.store.offset_table.flush_pending)),
            loop.create_task(self._every(cfg.expiry_check_s, self._expire_members)),
            loop.create_task(self._every(cfg.retention_check_s, self._retention)),
            loop.create_task(self._save_locks()),
            loop.create_task(self._every(self.guard.interval, self._sweep_connections)),
        ]
        log.info("broker listening on %s:%d (flush=%s)", cfg.host, self.port, cfg.store.flush)
        try:
            self.metrics = await start_metrics(self)
        except BaseException:  # e.g. the metrics port is in use
            await self.stop()
            raise

    async def _every(self, seconds: float, fn: Callable[[], Any]) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                result = fn()
                if asyncio.iscoroutine(result):
                    await result
            except asyncio.CancelledError:
                raise
            except OSError as exc:  # a full or failing disk: one line per 10 s, no traceback
                name = getattr(fn, "__name__", str(fn))
                self.store.errors.error(f"task:{name}", "periodic task %s failed: %s",
                                        name, exc)
            except Exception:
                log.exception("periodic task %s failed", getattr(fn, "__name__", fn))

    async def _checkpoint(self) -> None:
        # fsync of indexes and the checkpoint file run off the loop; the list of fds and the
        # end position are taken on the loop so they are consistent.
        store = self.store
        if store.write_failure is not None:  # the log after the last checkpoint is suspect
            return
        end = store.log.end
        chunk = store.dedup_chunk(end)
        if self.flusher is not None:
            await self.flusher.flush_now()
        await self._off_loop(store.checkpoint_at, end, store.dirty_index_files(), chunk)

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking file work in a thread. A cancelled caller does not stop the thread,
        so the work is tracked and ``stop`` waits for it before closing the store (else a
        late checkpoint/offsets write races the final one on the same temp file)."""
        fut = asyncio.get_running_loop().run_in_executor(None, fn, *args)
        self._io.add(fut)
        fut.add_done_callback(self._io.discard)
        return await asyncio.shield(fut)

    async def _save_offsets(self) -> None:
        # the periodic save and the one before retention must not share the temp file
        async with self._offsets_lock:
            snap = self.store.offsets_snapshot()
            if snap is None:
                return
            try:
                await self._off_loop(self.store.write_offsets_file, *snap)
            except OSError:
                self.store.offsets_changed()  # written again on the next round and at close
                raise

    async def _save_sequences(self) -> None:
        """Expire idle writers; snapshot the sequence table when it changed."""
        self.sequences.expire()
        data = self.sequences.snapshot()
        if data is not None:
            await self._off_loop(self.sequences.write, data)

    def _restore_hold_ended(self) -> None:
        """Members that did not come back drop out of the member lists now: tell the groups."""
        for group in sorted({r.group for r in self.transition.table.export()}):
            for m in self.groups.members(group):
                m.conn.push(PushCode.GROUP_CHANGED, {"group": group, "client": "",
                                                     "reason": "restore-hold-ended"})

    def _locks_changed(self) -> None:
        if self._locks_dirty is not None:
            self._locks_dirty.set()

    async def _save_locks(self) -> None:
        """Write the access-lock holders whenever they change (one write at a time; changes
        made during a write are written by the next one)."""
        assert self._locks_dirty is not None
        while True:
            await self._locks_dirty.wait()
            self._locks_dirty.clear()
            try:
                await self._off_loop(self.transition.write_file, self.transition.file_data())
            except OSError as exc:
                self.store.errors.error("locks", "cannot save the access locks: %s; "
                                        "retrying", exc)
                self._locks_dirty.set()
                await asyncio.sleep(1.0)

    def _open_files_headroom(self) -> int:
        """Descriptors the store's cache of open files (index files, older segments) may
        still take: set aside from the connection cap."""
        files = self.store.open_files
        return files.capacity - len(files)

    def _sweep_connections(self) -> None:
        self.guard.sweep(self.connections)

    def _expire_members(self) -> None:
        for group, cid in self.groups.expire(self.clock()):
            log.info("group %s: member %s expired (no heartbeat)", group, cid)
        self.fence.expire(self.clock(), FENCE_MAX_AGE_S,
                          lambda g, c: self.groups.member(g, c) is not None)

    async def _retention(self) -> None:
        # a fresh offsets snapshot first: segments holding offset commits that no written
        # snapshot covers are kept
        await self._save_offsets()
        await self._save_sequences()  # segments a written snapshot covers may go
        deleted = self.store.run_retention()
        if deleted:
            log.info("retention deleted %d segment(s)", deleted)

    async def stop(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self._server is not None:
            self._server.close()
        if self.metrics is not None:
            await self.metrics.stop()
        self.holds.release_all()
        if self._hold_timer is not None:
            self._hold_timer.cancel()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.retry is not None:
            await self.retry.stop()
        if self._io:  # file work of cancelled periodic tasks still running in threads
            await asyncio.wait(list(self._io))
        if self.flusher is not None:
            await self.flusher.stop()
            await asyncio.sleep(0)  # let the answers of sync-flush sends go out first
        try:  # holders as they are now, before closing connections releases them
            self.transition.write_file(self.transition.file_data())
        except OSError as exc:
            log.error("cannot save the access locks: %s", exc)
        for conn in list(self.connections):
            conn.close()
        try:
            self.sequences.save()
        except OSError as exc:  # rebuilt from the log at the next start
            log.error("cannot save the writers' sequences: %s", exc)
        self.trace.close()  # the members' disconnects at shutdown are not traced
        self.store.close()
        log.info("broker stopped")

    # ================================================================ dispatch
    def dispatch(self, conn: Connection, kind: int, code: int, corr_id: int,
                 raw_header: bytes, payload: bytes) -> None:
        if kind != REQUEST:
            return  # clients send requests only; anything else is ignored
        try:
            handler = self.handlers.get(code)
            if handler is None:
                raise OnceqError(ErrorCode.UNKNOWN_REQUEST, f"unknown request code {code}")
            if self._closing:
                raise OnceqError(ErrorCode.SHUTTING_DOWN)
            try:
                header = decode_header(raw_header)
            except ValueError as exc:
                raise OnceqError(ErrorCode.BAD_REQUEST, str(exc)) from None
            result = handler(conn, corr_id, header, payload)
        except OnceqError as exc:
            conn.respond(corr_id, int(exc.code), {"message": exc.message})
            return
        except OSError as exc:  # disk trouble outside the store's own handling: no trace
            err = storage_error(exc, "the request failed")
            self.store.errors.error(f"request:{code}", "request %s failed: %s", code, exc)
            conn.respond(corr_id, int(err.code), {"message": err.message})
            return
        except Exception as exc:
            log.exception("request %s failed", code)
            conn.respond(corr_id, int(ErrorCode.SYSTEM_ERROR), {"message": f"internal: {exc}"})
            return
        if result is not None:
            rcode, rheader, rpayload = result
            conn.respond(corr_id, rcode, rheader, rpayload)

    def on_disconnect(self, conn: Connection) -> None:
        self.connections.discard(conn)
        self.holds.drop_connection(conn)
        for group, cid in self.groups.drop_connection(conn):
            log.info("group %s: member %s left (connection closed)", group, cid)

    # ================================================================ handlers
    def h_ping(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes) -> Response:
        return 0, {"time": int(self.clock() * 1000)}, b""

    def _topic_for_write(self, topic: str) -> None:
        _user_topic(topic)
        if topic not in self.store.topics and self.config.auto_create_topics:
            check_name("topic", topic)
            self.store.create_topic(topic, self.config.default_queues)

    def h_send(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes) -> Response:
        topic = _str(h, "topic")
        qid = _int(h, "queue")
        self._topic_for_write(topic)
        parts = split_parts(p)
        refuse_sequenced(topic, parts)
        res = self.store.put(topic, qid, parts)
        if len(res.duplicates) < len(parts):
            self.holds.notify((topic, qid))
        if self.metrics is not None:
            self.metrics.on_send(topic, len(parts), len(p), len(res.duplicates))
        if res.duplicates:
            header = {"queue": qid, "offsets": res.offsets, "dups": res.duplicates,
                      "dupq": res.duplicate_queues}
        else:
            header = {"queue": qid, "base": res.offsets[0], "n": len(res.offsets)}
        return self._durable_reply(conn, corr, header, res.end_position)

    def h_send_sequenced(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                         ) -> Response:
        """An idempotent writer's numbered batch (``idempotent.py``)."""
        topic = _str(h, "topic")
        qid = _int(h, "queue")
        self._topic_for_write(topic)
        return send_sequenced(self, conn, corr, h, split_parts(p), topic, qid)

    def _pull_request(self, h: dict[str, Any]) -> dict[str, Any]:
        req = {
            "topic": _user_topic(_str(h, "topic")),
            "queue": _int(h, "queue"),
            "offset": _int(h, "offset"),
            "max": min(max(_int(h, "max", 32), 1), self.config.max_pull_msgs),
            "max_bytes": min(max(_int(h, "max_bytes", self.config.max_pull_bytes), 1),
                             self.config.max_pull_bytes),
            "suspend_ms": max(_int(h, "suspend_ms", 0), 0),
            "group": None,
            "client": None,
        }
        tags = h.get("tags")
        if tags is not None:
            if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
                raise OnceqError(ErrorCode.INVALID_ARGUMENT, "tags must be a list of strings")
            req["tag_hashes"] = frozenset(tag_hash(t) for t in tags)
        else:
            req["tag_hashes"] = None
        return req

    def h_pull(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes) -> Response:
        req = self._pull_request(h)
        topic, queue = req["topic"], req["queue"]
        self.store.get_topic(topic)
        group = h.get("group")
        if group is not None:
            group = check_name("group", group)
        commit = _int(h, "commit") if "commit" in h else -1
        client = h.get("client")
        if group is not None and isinstance(client, str):
            self.fence.seen(group, client, h.get("reset_gen"))
            if self.fence.blocks(group, client, topic, queue):  # before it saw the reset:
                return 0, self._locked(topic, queue, req["offset"]), b""  # nor its commit
        if group is not None and self.queue_locks.refuses(group, client, topic, queue):
            return 0, self._locked(topic, queue, req["offset"]), b""  # orderly lock
        traced = group is not None and group in self.trace.groups  # delivery trace (trace.py)
        acquired = False  # this pull made the client the queue's lock holder
        if isinstance(client, str) and self.transition.applies(group, client):
            acquired = traced and self.transition.table.holder(group, topic, queue) != client
            grant = self.transition.check(group, client, topic, queue, req["offset"])
            if not grant.granted:  # a refused client's commit must not move the offset
                return 0, self._locked(topic, queue, req["offset"]), b""
            if grant.offset > req["offset"]:  # taken over and moved forward to the group's
                commit = -1  # offset: the client's commit is its stale start, not progress
            req["offset"] = grant.offset
            req["group"], req["client"] = group, client
        elif group is not None and commit >= 0 and not self._may_commit(
                group, client if isinstance(client, str) else None, topic, queue):
            commit = -1  # another client holds the queue: its commits count
        if traced:
            req["trace"] = (group, client if isinstance(client, str) else "", acquired)
        if group is not None and commit >= 0:
            # journaled with the next batch, not waited for: a consumer sends its finished
            # offsets again after a reconnect (and with its next pull)
            self.store.commit_offset_later(group, topic, queue, commit)
        res = self._do_pull(req)
        if res is None:
            seconds = min(req["suspend_ms"] / 1000, self.config.long_poll_max_s)
            if req["client"] is not None:  # a suspended holder is alive: keep its lock
                self.transition.touch(group, client, topic, queue)
            self.holds.hold((topic, queue), HeldPull(conn, corr, req), seconds)
            return None
        return res

    def _do_pull(self, req: dict[str, Any], final: bool = False) -> Response:
        """Run a pull; None means 'nothing yet, hold it' (only when it may be held)."""
        r = self.store.get(req["topic"], req["queue"], req["offset"], req["max"],
                           req["max_bytes"], req["tag_hashes"])
        if r.status == PullStatus.NO_NEW_MESSAGE and req["suspend_ms"] > 0 and not final:
            if r.next_offset != req["offset"]:
                req["offset"] = r.next_offset  # filtered entries skipped: wait from there
            return None
        if r.status == PullStatus.FOUND:
            if req["client"] is not None:
                self.transition.delivered(req["group"], req["topic"], req["queue"],
                                          r.next_offset)
            if "trace" in req:
                self.trace.delivered(*req["trace"], req["topic"], req["queue"], r.payload)
            if self.metrics is not None:
                self.metrics.on_pull(req["topic"], r.count, len(r.payload))
        hdr = {"st": int(r.status), "next": r.next_offset, "min": r.min_offset,
               "max": r.max_offset, "n": r.count}
        if r.status == PullStatus.DAMAGED:  # offsets [damaged[0], damaged[1]) are lost
            hdr["damaged"] = [req["offset"], r.next_offset]
        return 0, hdr, r.payload

    def _locked(self, topic: str, queue: int, offset: int) -> dict[str, Any]:
        """A refused pull: "queue is locked by another client", same next offset."""
        lo, hi = self.store.min_max(topic, queue)
        return {"st": int(PullStatus.LOCKED), "next": offset, "min": lo, "max": hi, "n": 0}

    def _retry_pull(self, held: HeldPull, final: bool) -> bool:
        try:
            req = held.request
            if req["topic"] not in self.store.topics:
                raise OnceqError(ErrorCode.TOPIC_NOT_EXIST, "topic was deleted")
            if req["client"] is not None and not self.transition.is_holder(
                    req["group"], req["client"], req["topic"], req["queue"]):
                held.conn.respond(held.corr_id, 0,
                                  self._locked(req["topic"], req["queue"], req["offset"]))
                return True
            res = self._do_pull(req, final)
        except OnceqError as exc:
            held.conn.respond(held.corr_id, int(exc.code), {"message": exc.message})
            return True
        except Exception as exc:  # answer it: the puller must not wait for its timeout
            log.exception("held pull failed")
            held.conn.respond(held.corr_id, int(ErrorCode.SYSTEM_ERROR),
                              {"message": f"internal: {exc}"})
            return True
        if res is None:
            return False
        held.conn.respond(held.corr_id, *res)
        return True

    def h_query_offsets(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                        ) -> Response:
        lo, hi = self.store.min_max(_str(h, "topic"), _int(h, "queue"))
        return 0, {"min": lo, "max": hi}, b""

    def h_search_offset(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                        ) -> Response:
        off = self.store.search_offset(_str(h, "topic"), _int(h, "queue"), _int(h, "ts"))
        return 0, {"offset": off}, b""

    def h_commit_offset(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                        ) -> Response:
        offset = _int(h, "offset")
        if offset < 0:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "offset must be >= 0")
        group = check_name("group", _str(h, "group"))
        topic, queue = _user_topic(_str(h, "topic")), _int(h, "queue")
        client = h.get("client")
        if client is not None and not isinstance(client, str):
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "field 'client' must be a string")
        self.store.min_max(topic, queue)  # TOPIC_NOT_EXIST / INVALID_QUEUE first
        self.fence.seen(group, client, h.get("reset_gen"))
        if self.fence.blocks(group, client, topic, queue):
            raise OnceqError(ErrorCode.NOT_HOLDER, (
                f"the offsets of group {group!r} on {topic}:{queue} were reset; client "
                f"{client!r} must take the queue again first"))
        if not self._may_commit(group, client, topic, queue):
            holder = self.transition.table.holder(group, topic, queue)
            raise OnceqError(ErrorCode.NOT_HOLDER, (
                f"client {client!r} does not hold {topic}:{queue} of group {group!r} "
                f"(holder: {holder or 'none'}); only the holder's commits count"))
        end = self.store.commit_offset(group, topic, queue, offset)
        return self._durable_reply(conn, corr, {}, end)

    def _may_commit(self, group: str, client: str | None, topic: str, queue: int) -> bool:
        """Whether a commit from ``client`` (None: it sent no id) may set the group's offset.

        A member the access lock applies to must hold the queue; any other committer (a
        pull consumer, a group without the lock) only while no other client holds it."""
        if self.queue_locks.refuses(group, client, topic, queue):
            return False  # another client holds the queue's orderly lock
        holder = self.transition.table.holder(group, topic, queue)
        if client is not None and self.transition.applies(group, client):
            return holder == client
        return holder is None or holder == client

    def h_get_offset(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                     ) -> Response:
        group = check_name("group", _str(h, "group"))
        off = self.store.get_offset(group, _str(h, "topic"), _int(h, "queue"))
        return 0, {"offset": off}, b""

    def h_create_topic(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                       ) -> Response:
        name = _user_topic(_str(h, "topic"))
        queues = _int(h, "queues", self.config.default_queues)
        if h.get("exclusive") and name in self.store.topics:
            raise OnceqError(ErrorCode.TOPIC_EXISTS, f"topic {name!r} already exists")
        t = self.store.create_topic(name, queues)
        log.info("topic %s created/updated with %d queues", name, t.queues)
        return 0, {"topic": t.name, "queues": t.queues}, b""

    def h_delete_topic(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                       ) -> Response:
        name = _user_topic(_str(h, "topic"))
        self.store.delete_topic(name)
        self.sequences.table.drop_topic(name)
        self.transition.drop_topic(name)
        self.queue_locks.table.drop_topic(name)
        self.fence.drop_topic(name)
        for key in [k for k in self.holds.held if k[0] == name]:
            self.holds.notify(key)
        log.info("topic %s deleted", name)
        return 0, None, b""

    def h_list_topics(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                      ) -> Response:
        topics = [{"topic": t.name, "queues": t.queues} for t in
                  sorted(self.store.topics.values(), key=lambda t: t.name)
                  if t.name != OFFSETS_TOPIC]
        return 0, {"topics": topics}, b""

    def h_get_topic(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                    ) -> Response:
        name = _str(h, "topic")
        self._topic_for_write(name)
        t = self.store.get_topic(name)
        return 0, {"topic": t.name, "queues": t.queues}, b""

    def h_heartbeat(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                    ) -> Response:
        client = _str(h, "client")
        if not 1 <= len(client) <= 255:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "client id must be 1-255 characters")
        groups = h.get("groups", [])
        if not isinstance(groups, list):
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "groups must be a list")
        checked = []
        for g in groups:  # validate everything first: a bad heartbeat changes nothing
            if not isinstance(g, dict):
                raise OnceqError(ErrorCode.INVALID_ARGUMENT, "each group must be a map")
            name = check_name("group", g.get("group"))
            subs = g.get("subs", {})
            if not isinstance(subs, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in subs.items()):
                raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                                 "subs must be a map of topic -> tag expression")
            model = g.get("model", CLUSTERING)
            if model not in (CLUSTERING, BROADCASTING):
                raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                                 f"model must be {CLUSTERING} or {BROADCASTING}")
            meta = g.get("meta")
            if meta is not None and not isinstance(meta, dict):
                raise OnceqError(ErrorCode.INVALID_ARGUMENT, "meta must be a map")
            checked.append((name, subs, model, meta, _held(g), g.get("reset_gen")))
        now = self.clock()
        holds = []
        resets = []
        for name, subs, model, meta, held, reset_gen in checked:
            if model == CLUSTERING and self.retry is not None:
                try:
                    self.retry.ensure_group_topics(name)
                except OnceqError as exc:  # a full disk: created by a later heartbeat
                    if not exc.retriable:
                        raise
            self.groups.heartbeat(name, client, conn, model, subs, now, meta)
            self.fence.seen(name, client, reset_gen)
            pending = self.fence.pending(name, client)
            if pending is not None:  # a forced reset it has not handled: repeat it, and
                resets.append(pending)  # do not let its held list take those queues back
                if held is not None:
                    held = [x for x in held
                            if not self.fence.blocks(name, client, x[0], x[1])]
            # the queues the member holds (after a reconnect: restore the access lock)
            if held is not None and self.transition.applies(name, client):
                holds += [[name, t, q, h] for t, q, h in
                          self.transition.reassert(name, client, held)]
        conn.client_ids.add(client)
        self.transition.touch_client(client)
        answer: dict[str, Any] = {"expiry_s": self.config.heartbeat_expiry_s, "holds": holds}
        if resets:
            answer["resets"] = resets
        return 0, answer, b""

    def h_unregister(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                     ) -> Response:
        group = check_name("group", _str(h, "group"))
        self.groups.unregister(group, _str(h, "client"), "leave")
        self.fence.drop_client(group, _str(h, "client"))
        return 0, None, b""

    def h_list_members(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                       ) -> Response:
        group = check_name("group", _str(h, "group"))
        if group not in self.groups.groups and group not in self.store.offsets:
            raise OnceqError(ErrorCode.GROUP_NOT_EXIST, f"consumer group {group!r} is unknown")
        members = [
            {"client": m.client_id, "model": m.model, "subs": m.subscriptions,
             "last_heartbeat_ms": int(m.last_heartbeat * 1000), "peer": m.conn.peer}
            for m in self.groups.members(group)
        ]
        known = {m["client"] for m in members}
        members += [  # holders saved before a restart, not reconnected yet
            {"client": cid, "model": CLUSTERING, "subs": {}, "peer": "(restored)",
             "last_heartbeat_ms": int(self._started * 1000), "restored": True}
            for cid in self.transition.restored_members(group) if cid not in known]
        return 0, {"group": group, "members": members}, b""

    def h_list_groups(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                      ) -> Response:
        names = sorted(set(self.groups.groups) | set(self.store.offsets))
        return 0, {"groups": names}, b""

    def h_send_back(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                    ) -> Response:
        assert self.retry is not None
        group = check_name("group", _str(h, "group"))
        max_reconsume = _int(h, "max_reconsume", 16)
        if not 0 <= max_reconsume <= 10_000:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "max_reconsume must be 0..10000")
        reason = h.get("dlq_reason", "")
        if not isinstance(reason, str):
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "field 'dlq_reason' must be a string")
        res = self.retry.send_back(group, _str(h, "topic"), _int(h, "queue"), _int(h, "offset"),
                                   _int(h, "delay_level", 0), max_reconsume, reason)
        return self._durable_reply(conn, corr, res)

    def _durable_reply(self, conn: Connection, corr: int, header: dict[str, Any],
                       end: int | None = None) -> Response:
        """Answer now, or (sync flush) once the bytes before ``end`` (default: everything
        written so far) are fsynced."""
        flusher = self.flusher
        end = self.store.log.end if end is None else end
        if flusher is not None and flusher.sync_policy and end > flusher.flushed:
            fut = flusher.wait_durable(end)
            fut.add_done_callback(lambda f: _answer_durable(conn, corr, header, f))
            return None
        return 0, header, b""

    def h_release_queue(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                        ) -> Response:
        """End of a drain: commit the final offset, drop held pulls, release the lock."""
        group = check_name("group", _str(h, "group"))
        client, topic, queue = _str(h, "client"), _str(h, "topic"), _int(h, "queue")
        if topic not in self.store.topics:  # deleted meanwhile: nothing left to release
            self.transition.release(group, client, topic, queue)
            return 0, {"released": False}, b""
        offset = _int(h, "offset", -1)
        for held in self.holds.drop_client((topic, queue), client):
            held.conn.respond(held.corr_id, 0,
                              self._locked(topic, queue, held.request["offset"]))
        # only the holder (or a group without the lock) commits: a client that never got
        # the queue must not move its offset back under the one still draining it
        applies = self.transition.applies(group, client)
        self.fence.seen(group, client, h.get("reset_gen"))
        may_commit = (self._may_commit(group, client, topic, queue)  # before the release
                      and not self.fence.blocks(group, client, topic, queue))
        released = self.transition.release(group, client, topic, queue)
        end = 0
        if offset >= 0 and may_commit and (released or not applies):
            if applies:  # the holder's reads were corrected forward to the group's offset:
                # a lower one is its stale start (its first pull still held), not progress
                offset = max(offset, self.store.get_offset(group, topic, queue))
            end = self.store.commit_offset(group, topic, queue, offset)
        return self._durable_reply(conn, corr, {"released": released}, end)

    def h_reset_offsets(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                        ) -> Response:
        """Admin: move a group's offsets on a topic (see ``offset_reset.py``)."""
        group = check_name("group", _str(h, "group"))
        topic = _user_topic(_str(h, "topic"))
        force = h.get("force", False)
        if not isinstance(force, bool):
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "force must be a boolean")
        targets = parse_targets(h.get("offsets"), self.store.get_topic(topic).queues)
        answer, end = reset_offsets(self, group, topic, targets, force)
        return self._durable_reply(conn, corr, answer, end)

    def h_query_access_locks(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                             ) -> Response:
        group = check_name("group", _str(h, "group"))
        return 0, {"group": group, "enabled": self.config.access_lock,
                   "queues": self.transition.status(group),
                   "orderly": self.queue_locks.status(group)}, b""

    def h_broker_status(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                        ) -> Response:
        """Store health: log range, flush policy, damaged positions and offsets, whether
        writes are accepted, the dedup window; the retry delay levels (seconds), which
        consumers need to size their dedup retention."""
        store = self.store
        return 0, {"log_start": store.log.start, "log_end": store.log.end,
                   "flush": self.config.store.flush, "damaged": store.damaged(),
                   "writes": store.write_state(),
                   "dedup": store.dedup.status(int(store.clock() * 1000)),
                   "delay_levels": list(self.retry.levels)}, b""

    def _on_internal_put(self, topic: str, queue: int) -> None:
        self.holds.notify((topic, queue))

    # ================================================================ notifications
    def _on_group_change(self, group: str, client_id: str, reason: str) -> None:
        log.info("group %s: %s %s", group, client_id, reason)
        self.trace.member(group, client_id, reason)
        if reason in ("leave", "disconnect", "expired"):
            self.transition.member_gone(group, client_id, reason)
            self.queue_locks.member_gone(group, client_id, reason)
        for m in self.groups.members(group):
            m.conn.push(PushCode.GROUP_CHANGED, {"group": group, "client": client_id,
                                                 "reason": reason})
