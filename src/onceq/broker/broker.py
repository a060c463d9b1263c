"""The onceq broker: lifecycle, periodic tasks and the dispatch of requests to the services
that handle them, on one asyncio loop.

The services, each one job (see docs/broker.md, "Code map"):

* ``send.py``: sends, sequenced sends, send-backs to the retry topic;
* ``pull.py``: pulls, long polling, offset queries;
* ``consumer_group.py``: heartbeats and members, ack-offset commits, queue releases, resets;
* ``ownership_service.py``: the queue-ownership core (``ownership.py``: access lock, orderly
  queue lock, reset fences, commit rule) with the store's facts, its saved state, and the
  orderly lock requests;
* ``topic_admin.py`` and ``admin_ops.py``: topics, broker status, access locks, message
  lookup, the delivery trace switch.

They share the state this class owns and wires together: the store, the member registry
(``groups.py``), queue ownership (``ownership_service.py``) and the durable answers
(``durable.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from .._net import is_loopback
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.frame import REQUEST, decode_header, max_frame_for_body
from ..protocol.replies import GroupChanged, Pong, RouteChanged
from ..protocol.requests import (
    REQUESTS,
    CommitOffset,
    CreateTopic,
    DeleteGroup,
    DeleteTopic,
    GetOffset,
    GetTopic,
    Heartbeat,
    ListGroupMembers,
    ListGroups,
    LockQueues,
    Ping,
    Pull,
    QueryOffsets,
    ReleaseQueue,
    ReplicaEpochEnd,
    ReplicaFetch,
    ResetOffsets,
    SearchOffset,
    Send,
    SendBack,
    SendBatch,
    SendRecords,
    SendSequenced,
    UnlockQueues,
    Unregister,
)
from ..protocol.schema import Message
from ..storage.failures import storage_error
from ..storage.files import OS_FILES, FileOps
from ..storage.sequences import SequenceStore
from ..storage.store import MessageStore
from .admin_ops import AdminOps
from .client_ids import CLAIMING, ClientIds
from .cluster_node import ClusterNode
from .config import BrokerConfig
from .connection import Connection
from .consumer_group import ConsumerGroupService
from .durable import DurableReplies
from .fields import Call, Handler
from .flush import Flusher
from .front_end import FrontEnd
from .fuse import store_fuse
from .groups import GroupRegistry
from .limits import ConnectionGuard
from .metrics import BrokerMetrics, start_metrics
from .ownership_service import OwnershipService
from .pull import PullService
from .queue_move import QueueMoves
from .queue_scaler import QueueScaler
from .recent_errors import RecentErrors
from .reply_route import ReplyRoutes
from .retry import RetryService, parse_delay_levels
from .routes import Routes
from .security import Security
from .send import SendService
from .shared_security import SharedSecurity
from .store_errors import StorageError, wire_error
from .tls import server_context
from .topic_admin import TopicAdmin
from .trace import DeliveryTrace

log = logging.getLogger("onceq.broker")


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
                                     max_output=config.output_budget(),
                                     headroom=self._open_files_headroom)
        self.durable = DurableReplies(self.store)  # answers once a write is fsynced
        self.groups = GroupRegistry(config.heartbeat_expiry_s,
                                    lambda *change: self.consumer_groups.on_group_change(*change))
        self.files = files
        # who holds each queue of each group, whose commits count (saved on change)
        self.owners = OwnershipService(config, self.store, self.groups, clock,
                                       durable=self.durable, files=files,
                                       on_change=self._locks_changed)
        self.trace = DeliveryTrace(self.store, clock, self._on_internal_put)
        self.pulls = PullService(config, self.store, owners=self.owners, trace=self.trace)
        self.holds = self.pulls.holds  # held long-poll pulls
        self.client_ids = ClientIds()  # which connection owns each client id
        self.consumer_groups = ConsumerGroupService(
            config, self.store, clock, groups=self.groups, owners=self.owners,
            pulls=self.pulls, trace=self.trace, durable=self.durable,
            client_ids=self.client_ids)
        self.sends = SendService(config, self.store, self.sequences, self.durable,
                                 self._on_internal_put)
        self.sends.fuse = store_fuse(config, self.store)  # the queue-depth fuse, when on
        topics = TopicAdmin(self.store, config.default_queues,
                            topic_for_write=self.sends.topic_for_write,
                            forget_topic=self._forget_topic, off_loop=self._off_loop,
                            log_durable=self._log_durable)
        # queues that follow a consumer group (queue_scaler.py)
        self.scaling = topics.scaling = QueueScaler(
            self.store, self.groups, clock, grace_s=config.queue_scaling_grace_s,
            settle_s=config.queue_scaling_settle_s,
            start_hold_s=config.access_lock_restore_hold_s, wake=self.pulls.wake)
        self.consumer_groups.on_members = self.scaling.on_members
        self.security = Security(config, clock)  # users, grants, the audit log
        self.recent_errors = RecentErrors()  # for BROKER_STATUS, while the broker runs
        self.replies = ReplyRoutes(clock)  # request-reply: reply channels, replies routed
        self.admin = AdminOps(config, self.store, clock, owners=self.owners, trace=self.trace,
                              closing=lambda: self._closing,
                              recent_errors=self.recent_errors)
        self.admin.fuse = self.sends.fuse
        self._locks_dirty: asyncio.Event | None = None
        self._hold_timer: asyncio.TimerHandle | None = None
        self.flusher: Flusher | None = None
        self.retry: RetryService | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._io: set[asyncio.Future[Any]] = set()
        self._offsets_lock = asyncio.Lock()  # one offsets snapshot write at a time
        # one writers.json write at a time; retention waits for a write under way
        self._sequences_lock = asyncio.Lock()
        self._closing = False
        self.port = config.port
        self.metrics: BrokerMetrics | None = None  # counters, when metrics_port is set
        # other front ends on this loop (front_end.py: the RocketMQ gRPC endpoint)
        self.front_ends: list[FrontEnd] = []
        # in a broker group (--cluster): its role and the log replication (docs/cluster.md)
        self.cluster: ClusterNode | None = None
        if config.clustered:
            self.cluster = node = ClusterNode(
                config, self.store, flusher=lambda: self.flusher, on_hw=self._hw_moved,
                on_append=lambda: None, on_promoted=self._promoted)
            self.durable.replicated = node.replicated
            self.pulls.visible_end = node.visible_end
            self.admin.cluster_status = node.status
        # topics over several broker groups: their routes in etcd (routes.py)
        self.routes = Routes(self.store, config.default_queues,
                             config.group if config.clustered else None,
                             is_leader=lambda: self.cluster is not None
                             and self.cluster.is_leader(), create_local=topics.ensure)
        self.routes.on_change = self._route_changed
        if self.cluster is not None:  # the routes' upkeep in BROKER_STATUS
            status, routes = self.cluster.status, self.routes
            self.admin.cluster_status = lambda: {**status(), "routes": routes.state()}
        groups, pulls, sends = self.consumer_groups, self.pulls, self.sends
        handlers: dict[type[Message], Handler] = {
            Ping: self.h_ping,
            Send: sends.h_send,
            SendBatch: sends.h_send,
            SendRecords: sends.h_send_records,
            SendSequenced: sends.h_send_sequenced,
            SendBack: sends.h_send_back,
            Pull: pulls.h_pull,
            QueryOffsets: pulls.h_query_offsets,
            SearchOffset: pulls.h_search_offset,
            GetOffset: pulls.h_get_offset,
            Heartbeat: groups.h_heartbeat,
            Unregister: groups.h_unregister,
            ListGroupMembers: groups.h_list_members,
            ListGroups: groups.h_list_groups,
            CommitOffset: groups.h_commit_offset,
            ReleaseQueue: groups.h_release_queue,
            ResetOffsets: groups.h_reset_offsets,
            DeleteGroup: groups.h_delete_group,
            LockQueues: self.owners.h_lock,
            UnlockQueues: self.owners.h_unlock,
            ReplicaFetch: self.h_replica_fetch,
            ReplicaEpochEnd: self.h_replica_epoch_end,
            **topics.handlers(),
            **self.admin.handlers(),
            **self.security.handlers(),
            **self.replies.handlers(),
            **self.routes.handlers(),
            **QueueMoves(self.store, self.routes, self.durable).handlers(),
        }
        handlers[CreateTopic] = self.routes.creating(handlers[CreateTopic])
        if config.clustered:
            self.routes.guard(handlers, Send, SendBatch, SendRecords, SendSequenced, Pull,
                              QueryOffsets, SearchOffset, GetOffset, CommitOffset, GetTopic)
            handlers[DeleteTopic] = self.routes.deleting(handlers[DeleteTopic])
        self.scaling.guard(handlers, Send, SendBatch, SendRecords, SendSequenced)
        self.pulls.visible_end = self.scaling.read_limit(self.pulls.visible_end)
        # request code -> (its request type, its handler)
        self.handlers: dict[int, tuple[type[Message], Handler]] = {
            cls.CODE: (cls, h) for cls, h in handlers.items()}
        assert set(self.handlers) == set(REQUESTS), "a request type without a handler"

    # ================================================================ lifecycle
    async def start(self) -> None:
        self.config.check_exposure()  # no listening beyond loopback without ACLs
        self.recent_errors.install()
        t0 = time.perf_counter()
        self.store.open()
        log.info("store opened in %.2fs (%d records)", time.perf_counter() - t0,
                 self.store.recovered_records)
        self.sequences.open()
        self.consumer_groups.started = self.clock()
        self.trace.load()
        # access and orderly locks, fences: kept for their holders after a restart
        if self.owners.load():  # when the restore hold ends, the groups rebalance
            self._hold_timer = asyncio.get_running_loop().call_later(
                self.config.access_lock_restore_hold_s, self._restore_hold_ended)
        self._locks_dirty = asyncio.Event()
        cfg = self.config
        self.retry = RetryService(self.store, parse_delay_levels(cfg.delay_levels), self.clock,
                                  self._on_internal_put)
        self.retry.on_group_topic = self.consumer_groups.retry_topic_created
        self.retry.start()
        self.sends.retry = self.consumer_groups.retry = self.admin.retry = self.retry
        self.flusher = Flusher(self.store, cfg.store.flush, cfg.store.flush_interval_ms)
        self.flusher.start()
        self.durable.flusher = self.flusher
        loop = asyncio.get_running_loop()
        max_frame = max_frame_for_body(cfg.store.max_body)
        self.guard.measure(0)
        try:
            self._server = await loop.create_server(
                lambda: Connection(self, max_frame, cfg.max_output_bytes), cfg.host, cfg.port,
                reuse_address=True, ssl=server_context(cfg))
            if not (cfg.acl or is_loopback(cfg.host)):
                log.warning("INSECURE: listening on %s without acl: anyone who reaches the "
                            "port can do anything", cfg.host)
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
                                         self.store.offsets.flush_pending)),
            loop.create_task(self._every(cfg.expiry_check_s, self._expire_members)),
            loop.create_task(self._every(cfg.retention_check_s, self._retention)),
            loop.create_task(self._save_locks()),
            loop.create_task(self._every(self.guard.interval, self._sweep_connections)),
            loop.create_task(self._every(self.scaling.tick_s, self.scaling.tick)),
        ]
        log.info("broker listening on %s:%d (flush=%s)", cfg.host, self.port, cfg.store.flush)
        if self.cluster is not None:
            node = self.cluster
            node.start(self.port)
            self.retry.paused = lambda: not node.is_leader()  # a follower writes nothing
            if node.role is not None:  # the topics' routes (etcd)
                self.routes.attach(node.role.client, cfg.cluster_name)
                self._tasks.append(loop.create_task(self.routes.run()))
            if cfg.acl and node.role is not None:  # users and grants: the cluster's (etcd)
                shared = SharedSecurity(node.role.client, cfg.cluster_name, self.security)
                self.security.shared = shared
                self._tasks.append(loop.create_task(shared.run()))
        try:
            self.metrics = await start_metrics(self)
            self.sends.metrics = self.pulls.metrics = self.metrics
            for front in self.front_ends:
                await front.start(self)
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
        chunk = store.checkpoints.dedup_chunk(end)
        if self.flusher is not None:
            await self.flusher.flush_now()
        await self._off_loop(store.checkpoints.checkpoint_at, end,
                             store.checkpoints.dirty_index_files(), chunk)

    async def _log_durable(self, end: int) -> None:
        """Return once the commit log is fsynced up to ``end`` (off the loop)."""
        flusher = self.flusher
        if flusher is None:  # not started: nothing to share the fsync with
            self.store.gate.sync_log()
            return
        if flusher.flushed < end:
            await flusher.flush_now()
        if flusher.flushed < end:  # writes stopped (a failed fsync): nothing is durable
            raise OnceqError(ErrorCode.STORAGE_ERROR, "the commit log cannot be made "
                             f"durable: {self.store.write_failure}")

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
            snap = self.store.offsets.snapshot()
            if snap is None:
                return
            try:
                await self._off_loop(self.store.offsets.write, *snap)
            except OSError:
                self.store.offsets.changed()  # written again on the next round and at close
                raise

    async def _save_sequences(self) -> None:
        """Expire idle writers; snapshot the sequence table when it changed."""
        async with self._sequences_lock:
            expired = self.sequences.expire()
            self.sends.writers.forget_users(self.sequences.table.writers, expired)
            data = self.sequences.snapshot()
            if data is not None:
                await self._off_loop(self.sequences.write, data)

    def _restore_hold_ended(self) -> None:
        """Members that did not come back drop out of the member lists now: tell the groups."""
        for group in sorted({r.group for r in self.owners.core.access.export()}):
            for m in self.groups.members(group):
                m.conn.push(GroupChanged(group, "", "restore-hold-ended"))

    def _locks_changed(self) -> None:
        if self._locks_dirty is not None:
            self._locks_dirty.set()

    def _saved_states(self) -> list[tuple[int, Callable[[], bytes], Callable[[bytes], None]]]:
        """What the broker saves when it changes: (change count, its data, its writer)."""
        return [(self.owners.core.changes, self.owners.file_data, self.owners.write_file)]

    async def _save_locks(self) -> None:
        """Write the queue-ownership state (access-lock holders, orderly queue locks, reset
        fences) whenever it changes (one write at a time; changes made during a write are
        written by the next one)."""
        assert self._locks_dirty is not None
        written: dict[int, int] = {}  # state index -> change count last written
        while True:
            await self._locks_dirty.wait()
            self._locks_dirty.clear()
            try:
                for i, (changes, data, write) in enumerate(self._saved_states()):
                    if written.get(i) != changes:
                        await self._off_loop(write, data())
                        written[i] = changes
            except OSError as exc:
                self.store.errors.error("locks", "cannot save the locks: %s; retrying", exc)
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
        self.owners.expire()

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
        self.recent_errors.remove()
        for front in reversed(self.front_ends):  # their requests end before the services'
            try:
                await front.stop()
            except Exception:
                log.exception("front end %s did not stop cleanly", front.name)
        if self._server is not None:
            self._server.close()
        if self.cluster is not None:  # resigns when leading: a successor is elected at once
            await self.cluster.stop()
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
        for _changes, data, write in self._saved_states():
            try:  # holders as they are now, before closing connections releases them
                write(data())
            except OSError as exc:
                log.error("cannot save the locks: %s", exc)
        for conn in list(self.connections):
            conn.close()
        try:
            self.sequences.save()
        except OSError as exc:  # rebuilt from the log at the next start
            log.error("cannot save the writers' sequences: %s", exc)
        self.trace.close()  # the members' disconnects at shutdown are not traced
        self.store.close()
        self.security.close()
        log.info("broker stopped")

    # ================================================================ dispatch
    def dispatch(self, conn: Connection, kind: int, code: int, corr_id: int,
                 raw_header: bytes, payload: bytes) -> None:
        if kind != REQUEST:
            return  # clients send requests only; anything else is ignored
        try:
            entry = self.handlers.get(code)
            if entry is None:
                raise OnceqError(ErrorCode.UNKNOWN_REQUEST, f"unknown request code {code}")
            if self._closing:
                raise OnceqError(ErrorCode.SHUTTING_DOWN)
            security = self.security
            if security.enabled:
                security.admit(conn, code, corr_id)  # a user first
            try:
                header = decode_header(raw_header)
            except ValueError as exc:
                raise OnceqError(ErrorCode.BAD_REQUEST, str(exc)) from None
            cls, handler = entry
            request = cls.decode(header, payload)  # typed and checked, once
            if security.enabled:
                security.authorize(conn, code, corr_id, request)
            if self.cluster is not None:  # a follower serves no client (NOT_LEADER)
                self.cluster.admit(code)
            if code in CLAIMING:
                self.client_ids.check(conn, request.client)  # type: ignore[attr-defined]
            result = handler(Call(conn, corr_id), request)
            if result is not None:  # encoded here: a reply that cannot be is an error answer
                conn.answer(corr_id, result)
        except OnceqError as exc:
            conn.respond(corr_id, int(exc.code), {**exc.details, "message": exc.message})
        except StorageError as exc:
            err = wire_error(exc)
            conn.respond(corr_id, int(err.code), {"message": err.message})
        except OSError as exc:  # disk trouble outside the store's own handling: no trace
            err = wire_error(storage_error(exc, "the request failed"))
            self.store.errors.error(f"request:{code}", "request %s failed: %s", code, exc)
            conn.respond(corr_id, int(err.code), {"message": err.message})
        except Exception as exc:
            log.exception("request %s failed", code)
            conn.respond(corr_id, int(ErrorCode.SYSTEM_ERROR), {"message": f"internal: {exc}"})

    def on_disconnect(self, conn: Connection) -> None:
        self.connections.discard(conn)
        self.holds.drop_connection(conn)
        self.client_ids.drop(conn)
        self.replies.drop(conn)
        self.sends.writers.drop(conn)
        for group, cid in self.groups.drop_connection(conn):
            log.info("group %s: member %s left (connection closed)", group, cid)

    # ================================================================ handlers
    def _route_changed(self, topic: str, route: Any) -> None:
        """Tell the consumers subscribed to ``topic`` that its route changed (they fetch
        it again and rebalance, rather than find out at their next route fetch)."""
        push = RouteChanged(topic, 0 if route is None else route.version)
        for members in self.groups.groups.values():
            for m in members.values():
                if topic in m.subscriptions:
                    m.conn.push(push)

    def h_ping(self, call: Call, req: Ping) -> Pong:
        return Pong(int(self.clock() * 1000))

    def h_replica_fetch(self, call: Call, req: ReplicaFetch) -> None:
        self._clustered().h_fetch(call, req)

    def h_replica_epoch_end(self, call: Call, req: ReplicaEpochEnd) -> Message:
        return self._clustered().h_epoch_end(call, req)  # type: ignore[return-value]

    def _clustered(self) -> ClusterNode:
        if self.cluster is None:
            raise OnceqError(ErrorCode.UNKNOWN_REQUEST,
                             "this broker is standalone: it belongs to no broker group")
        return self.cluster

    # ================================================================ broker groups
    def _hw_moved(self, hw: int) -> None:
        """More of the log may be read: retry the held pulls."""
        for key in list(self.holds.held):
            self.holds.notify(key)

    def _promoted(self) -> None:
        """This broker leads now: what followers do not keep up to date in memory is read
        again from the replicated log (committed offsets, idempotent writers)."""
        try:
            self.store.offsets.open()
            self.sequences.open()
        except OSError as exc:
            log.error("new leader: cannot reload offsets and writers: %s", exc)

    # ================================================================ notifications
    def _on_internal_put(self, topic: str, queue: int) -> None:
        self.pulls.wake(topic, queue)
        if self.cluster is not None:  # followers waiting for records get them now
            self.cluster.log_grew()

    def _forget_topic(self, topic: str) -> None:
        """A deleted topic: drop it from every table that names its queues."""
        self.sequences.table.drop_topic(topic)
        self.owners.drop_topic(topic)
        if self.sends.fuse is not None:
            self.sends.fuse.forget_topic(topic)
        self.pulls.wake_topic(topic)
