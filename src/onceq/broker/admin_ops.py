"""Admin requests: broker status, access-lock query, message lookup by key, delivery-trace
switch. (Topic administration is ``topic_admin.py``.)

Message lookup (``QUERY_MESSAGE``) is a bounded scan, not an index: the broker keeps no
key index (RocketMQ keeps an index file per hour of keys; onceq's dedup window only
remembers unique keys for its window). For each queue of the topic it finds the first
offset stored at or after ``begin_ms`` (a binary search of the consume queue, as for an
offset reset by time), then reads records forward until their store time passes
``end_ms``, comparing the unique key or the business keys of each record's header. The
scan stops after ``max_scan`` records in all (default 1,000,000; at most 10,000,000) and
says so (``truncated``), or after ``max_results`` matches. Cost: one read of every record
stored in the time range, about the cost of a pull of it; the scan yields to other
requests every ``_CHUNK`` records (about a millisecond), at most ``MAX_RUNNING_SCANS`` scans
run at once and the others wait in line, and a query past ``MAX_SCANS`` running or waiting
is refused with ``SYSTEM_BUSY`` (retriable): scans slow the broker but do not stall it.

Without a time range, a unique-key lookup derives one from the key itself: onceq's
unique keys carry the producer's clock in milliseconds (``client/message.py``), so the
scan covers [born - 1 min, born + 1 h] (clock skew, producer retries, late re-sends).
A business-key lookup without a range scans the last 24 hours.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..log.record import RecordError, decode_records
from ..protocol.codes import SYSTEM_PREFIX, PullStatus
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import AccessLocks, FoundMessages, StatusReply, TraceReply
from ..protocol.requests import BrokerStatus, GroupTrace, QueryAccessLocks, QueryMessage
from ..storage.store import check_name
from .fields import Call
from .store_errors import as_wire_error

if TYPE_CHECKING:
    from ..protocol.schema import Message
    from ..storage.store import MessageStore
    from .config import BrokerConfig
    from .fields import Handler
    from .fuse import QueueFuse
    from .ownership_service import OwnershipService
    from .recent_errors import RecentErrors
    from .retry import RetryService
    from .trace import DeliveryTrace


DEFAULT_MAX_SCAN = 1_000_000
LIMIT_MAX_SCAN = 10_000_000
_CHUNK = 256
MAX_RUNNING_SCANS = 2  # scans that read at once (each yields every _CHUNK records)
MAX_SCANS = 16  # scans running or waiting for their turn; past it a query is refused
_HOUR_MS = 3_600_000


def unique_key_time_ms(key: str) -> int | None:
    """The producer's clock (epoch ms) inside a unique key from ``UniqueKeyGenerator``
    (40 hex digits, time at digits 20..31); None for a key of another shape."""
    if len(key) != 40:
        return None
    try:
        return int(key[20:32], 16)
    except ValueError:
        return None


def _opt_int(name: str, v: object, default: int, lo: int, hi: int) -> int:
    if v is None:
        v = default
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise OnceqError(ErrorCode.INVALID_ARGUMENT, f"field {name!r} must be an integer in "
                                                     f"[{lo}, {hi}]")
    return v


class AdminOps:
    """``closing()`` tells a running message lookup that the broker stops; ``retry`` is
    set when the broker starts."""

    def __init__(self, config: BrokerConfig, store: MessageStore, clock: Callable[[], float],
                 *, owners: OwnershipService, trace: DeliveryTrace,
                 closing: Callable[[], bool], recent_errors: RecentErrors | None = None
                 ) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self.owners = owners
        self.trace = trace
        self.closing = closing
        self.recent_errors = recent_errors
        # in a broker group: its role and replication state (cluster_node.py)
        self.cluster_status: Callable[[], dict[str, Any]] | None = None
        self.fuse: QueueFuse | None = None  # the queue-depth fuse, when on (set by the broker)
        self.retry: RetryService | None = None
        self._scans: set[asyncio.Task[None]] = set()
        self.max_scans = MAX_SCANS
        self._scan_turns: asyncio.Semaphore | None = None  # MAX_RUNNING_SCANS at once

    def handlers(self) -> dict[type[Message], Handler]:
        return {BrokerStatus: self.h_broker_status,
                QueryAccessLocks: self.h_query_access_locks,
                QueryMessage: self.h_query_message, GroupTrace: self.h_group_trace}

    # ---------------------------------------------------------------- status
    def h_broker_status(self, call: Call, req: BrokerStatus) -> StatusReply:
        """Store health: log range, flush policy, damaged positions and offsets, whether
        writes are accepted, the dedup window; the retry delay levels (seconds), which
        consumers need to size their dedup retention; the broker's recent warnings and
        errors (``recent_errors.py``)."""
        store = self.store
        return StatusReply(log_start=store.log.start, log_end=store.log.end,
                           flush=self.config.store.flush, damaged=store.repair.damaged(),
                           writes=store.gate.write_state(),
                           dedup=store.dedup.status(int(store.clock() * 1000)),
                           delay_levels=list(self.retry.levels),
                           recent_errors=(self.recent_errors.recent()
                                          if self.recent_errors is not None else []),
                           cluster=None if self.cluster_status is None
                           else self.cluster_status(),
                           fuse=None if self.fuse is None else self.fuse.summary(),
                           counts=self._counts() if req.counts else None)

    def _counts(self) -> dict[str, int]:
        """Messages ever stored in the user topics and the sum of the consumer groups'
        committed offsets on them: two reads give write and consume rates (``onceq
        cluster status``, the console). One pass over the queues and the offsets table:
        only when asked (not for the clients' leader lookups)."""
        store = self.store
        messages = sum(cq.max_offset for (topic, _), cq in list(store.topics.queues.items())
                       if not topic.startswith(SYSTEM_PREFIX))
        consumed = sum(max(0, offset) for topics in list(store.offsets.groups.values())
                       for topic, queues in list(topics.items())
                       if not topic.startswith(SYSTEM_PREFIX)
                       for offset in list(queues.values()))
        return {"messages": messages, "consumed": consumed}

    def h_query_access_locks(self, call: Call, req: QueryAccessLocks) -> AccessLocks:
        """A group's access-lock holders and orderly queue locks."""
        group = check_name("group", req.group)
        return AccessLocks(group, self.config.access_lock, self.owners.status(group),
                           self.owners.orderly_status(group))

    # ---------------------------------------------------------------- message lookup
    def h_query_message(self, call: Call, req: QueryMessage) -> None:
        store = self.store
        topic, key, by = req.topic, req.key, "unique" if req.by is None else req.by
        if not isinstance(topic, str) or not isinstance(key, str) or not key:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "fields 'topic' and 'key' must be "
                                                         "non-empty strings")
        if by not in ("unique", "keys"):
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "field 'by' must be unique or keys")
        queues = store.get_topic(topic).queues  # TOPIC_NOT_EXIST
        now = int(self.clock() * 1000)
        born = unique_key_time_ms(key) if by == "unique" else None
        if born is not None:
            begin_default, end_default = max(0, born - 60_000), born + _HOUR_MS
        else:
            begin_default, end_default = now - 24 * _HOUR_MS, now + 60_000
        begin = _opt_int("begin_ms", req.begin_ms, begin_default, 0, 2 ** 62)
        end = _opt_int("end_ms", req.end_ms, end_default, 0, 2 ** 62)
        if end < begin:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "end_ms is before begin_ms")
        max_scan = _opt_int("max_scan", req.max_scan, DEFAULT_MAX_SCAN, 1, LIMIT_MAX_SCAN)
        max_results = _opt_int("max_results", req.max_results, 32, 1, 1000)
        if len(self._scans) >= self.max_scans:
            raise OnceqError(ErrorCode.SYSTEM_BUSY, f"{len(self._scans)} message queries "
                             "running or waiting: try again later")
        task = asyncio.get_running_loop().create_task(self._scan(
            call, topic, queues, key, by, begin, end, max_scan, max_results))
        self._scans.add(task)
        task.add_done_callback(self._scans.discard)
        return None

    async def _scan(self, call: Call, topic: str, queues: int, key: str,
                    by: str, begin: int, end: int, max_scan: int, max_results: int) -> None:
        if self._scan_turns is None:
            self._scan_turns = asyncio.Semaphore(MAX_RUNNING_SCANS)
        try:
            async with self._scan_turns:
                found, scanned, truncated = await self._scan_queues(
                    topic, queues, key, by, begin, end, max_scan, max_results)
        except Exception as exc:  # answer it: the client must not wait for its timeout
            call.fail(as_wire_error(exc))
            return
        if not found:
            what = "unique key" if by == "unique" else "business key"
            more = (f"; the scan stopped after {scanned} records (raise max_scan or narrow "
                    "the time range)") if truncated else f"; {scanned} record(s) scanned"
            call.fail(OnceqError(ErrorCode.MESSAGE_NOT_FOUND, (
                f"no message with {what} {key!r} in topic {topic!r} stored between "
                f"{begin} and {end} (epoch ms){more}")))
            return
        call.answer(FoundMessages(topic, found, scanned, truncated, begin, end))

    async def _scan_queues(self, topic: str, queues: int, key: str, by: str, begin: int,
                           end: int, max_scan: int, max_results: int
                           ) -> tuple[list[dict[str, Any]], int, bool]:
        store = self.store
        found: list[dict[str, Any]] = []
        scanned = 0
        for q in range(queues):
            if topic not in store.topics:
                raise OnceqError(ErrorCode.TOPIC_NOT_EXIST, "topic was deleted")
            offset = store.reader.search_offset(topic, q, begin)
            while scanned < max_scan and len(found) < max_results:
                if self.closing():  # the store closes after the last answers
                    raise OnceqError(ErrorCode.SHUTTING_DOWN)
                r = store.get(topic, q, offset, min(_CHUNK, max_scan - scanned), 8 << 20)
                if r.status in (PullStatus.OFFSET_MOVED, PullStatus.DAMAGED):
                    offset = r.next_offset
                    continue
                if r.status != PullStatus.FOUND:
                    break
                past_end = False
                try:
                    for m in decode_records(r.payload, True, offset, r.next_offset):
                        if m.store_ts_ms > end:
                            past_end = True
                            break
                        scanned += 1
                        if (m.unique_key == key) if by == "unique" else key in m.key_list:
                            found.append({
                                "queue": m.queue_id, "offset": m.queue_offset,
                                "unique_key": m.unique_key, "keys": m.keys, "tags": m.tags,
                                "born_ms": m.born_ts_ms, "store_ms": m.store_ts_ms,
                                "reconsume": m.reconsume_times, "size": len(m.body),
                                "properties": m.properties})
                            if len(found) >= max_results:
                                past_end = True  # enough: the answer stops here
                                break
                except RecordError:  # verified by the store already: skip the rest
                    pass
                offset = r.next_offset
                if past_end:
                    break
                await asyncio.sleep(0)  # let other requests through between chunks
            if scanned >= max_scan or len(found) >= max_results:
                break
        return found, scanned, scanned >= max_scan

    # ---------------------------------------------------------------- trace switch
    def h_group_trace(self, call: Call, req: GroupTrace) -> TraceReply:
        """``enabled`` true/false turns the group's delivery trace on/off; without it,
        only answers. Answers whether it is on and every traced group."""
        trace = self.trace
        group, enabled = req.group, req.enabled
        if enabled is not None:
            if not isinstance(enabled, bool):
                raise OnceqError(ErrorCode.INVALID_ARGUMENT, "enabled must be a boolean")
            trace.set(check_name("group", group), enabled)
        elif group is not None:
            check_name("group", group)
        return TraceReply(group, group in trace.groups, sorted(trace.groups))
