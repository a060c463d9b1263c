"""Retries and dead letters: consumer send-back, delay levels, the schedule service; and
the delayed messages of producers (``send_delayed``, the ``%TIMER%`` topic, whose levels
``log/delay.py`` describes; docs/delayed.md).

A failed message is sent back by the consumer with (topic, queue, offset). The broker
re-reads it and stores a copy with reconsume_times + 1 and the same unique key:

* into ``%DLQ%<group>`` when the count passes the group's maximum, or reaches the largest
  count a message holds (``MAX_RECONSUME_TIMES``, where it stays) (nobody consumes it
  automatically; ``onceq dlq resend`` puts messages back, through ``resend_dead_letter``);
* otherwise into the schedule topic, queue ``level - 1``, with the real destination
  (``%RETRY%<group>``) and the due time in its properties. Each delay level has a fixed
  delay, so every schedule queue is in due-time order and the schedule service only has to
  watch its head. Its progress is kept as the offsets of the ``%SCHEDULE%`` group, saved
  with the other consumer offsets, so delayed messages survive a restart; a message
  moved again after a crash (its progress not yet saved) is recognised (below).

The broker alone writes ``%SCHEDULE%`` (client sends to system topics are refused), yet
the schedule service survives any record it reads, so that no record can stop the retries
of every group:

* **due time**: the earlier of the record's ``DELIVER_AT_MS`` and its store time plus its
  level's delay (the longest configured delay for a queue past the configured levels).
  The broker computes the due time from the same clock just before it stores the record,
  so for its own records the bound changes nothing; a due time past it (or delay levels
  shortened since) delivers at the bound. Nothing at the head of a level waits past its
  bound, so it never holds up the due records behind it for longer than their own delay.
* **target**: only a group retry topic, ``%RETRY%<group>`` queue 0 (the only target the
  broker writes): never another system topic (``%OFFSETS%`` would take a forged offset
  commit into the journal), nor a user topic.
* a record with another target, or whose due time or queue is not a decimal integer
  string, or that does not decode, is skipped (never delivered), counted in ``skipped``
  and logged at ERROR (one line per 10 s, with the number of repeats). A delivery the
  store refuses for good (e.g. the retry topic's queue is gone) is skipped the same way;
  one it cannot take now (full disk) is tried again a second later, dropping nothing.

The service moves the due heads of all the schedule queues (``%SCHEDULE%`` and
``%TIMER%``) in due-time order, and commits a queue's progress right after each move, with
no wait in between: after a kill at most the head record of each queue was moved without
its progress, and the first move of each queue after a start (or after this broker became
its group's leader) looks for that record's copy in its target first (``_moved_before``),
so a message is moved once whatever the dedup window. A ``%TIMER%`` record's target is a
user topic and queue (never a system topic); it moves on to another ``%TIMER%`` queue
until its delivery time comes (``log/delay.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

from .._aio import wait_event
from ..log.delay import (
    DELAYED,
    PROP_TIMER_DELIVER_MS,
    TIMER_LEVELS,
    TIMER_TOPIC,
    DelayError,
    check_delay,
    decimal_ms,
    level_ms,
    parse_deliver_ms,
    timer_due,
    timer_level,
)
from ..log.record import (
    PART_FIXED,
    PART_FIXED_SIZE,
    MessageExt,
    RecordError,
    check_part,
    decode_records,
    encode_part,
    variable_fields,
)
from ..log.sequence import SEQUENCED
from ..protocol.codes import (
    MAX_DLQ_REASON,
    MAX_RECONSUME_TIMES,
    PROP_DELIVER_AT,
    PROP_DLQ_REASON,
    PROP_ORIGIN_OFFSET,
    PROP_ORIGIN_QUEUE,
    PROP_ORIGIN_TOPIC,
    PROP_REAL_QUEUE,
    PROP_REAL_TOPIC,
    RETRY_PREFIX,
    SCHEDULE_TOPIC,
    SYSTEM_PREFIX,
    PullStatus,
    dlq_topic,
    retry_topic,
)
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import SendBackReply
from ..storage.put import PutResult
from ..storage.store import MessageStore, check_name
from .store_errors import StorageError

log = logging.getLogger("onceq.broker")

DEFAULT_DELAY_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
SCHEDULE_GROUP = "%SCHEDULE%"
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_READ_AHEAD = 16  # records of a schedule queue read at once
RECONCILE_SCAN = 4096  # records of a target queue looked through for a copy after a start


def parse_delay_levels(spec: str) -> list[float]:
    """``"1s 5s 10s 30s 1m ..."`` -> seconds per level (level 1 is the first)."""
    levels = []
    for tok in spec.split():
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", tok)
        if not m:
            raise ValueError(f"bad delay level {tok!r}: use forms like 500ms 1s 5m 2h")
        levels.append(float(m.group(1)) * _UNITS[m.group(2)])
    if not levels:
        raise ValueError("at least one delay level is needed")
    return levels


def retry_level(reconsume_times: int, requested: int, levels: int) -> int:
    """Delay level of the next retry: the requested one, else 3 + reconsume count."""
    level = requested if requested > 0 else 3 + reconsume_times
    return max(1, min(level, levels))


class BadScheduled(ValueError):
    """A schedule record the service must not deliver (it skips it)."""


def _decimal(props: dict, name: str) -> int:
    value = decimal_ms(props.get(name))
    if value is None:
        raise BadScheduled(f"{name} is not a decimal integer: {str(props.get(name))[:40]!r}")
    return value


def scheduled_delivery(m: MessageExt, delay_ms: int) -> tuple[int, str]:
    """(due time in ms, retry topic) of a schedule record whose level has a delay of
    ``delay_ms``; raise BadScheduled for a record the service must skip (module doc)."""
    props = m.properties
    target = props.get(PROP_REAL_TOPIC)
    if not isinstance(target, str) or not target.startswith(RETRY_PREFIX):
        raise BadScheduled(f"target {str(target)[:140]!r} is not a group retry topic")
    try:
        check_name("group", target[len(RETRY_PREFIX):])
    except StorageError:
        raise BadScheduled(f"target {target[:140]!r} is not a group retry topic") from None
    if _decimal(props, PROP_REAL_QUEUE) != 0:
        raise BadScheduled(f"target queue {props[PROP_REAL_QUEUE]!r} of {target} is not 0")
    return min(_decimal(props, PROP_DELIVER_AT), m.store_ts_ms + delay_ms), target


class RetryService:
    def __init__(self, store: MessageStore, delay_levels: list[float],
                 clock: Callable[[], float], on_put: Callable[[str, int], None]) -> None:
        self.store = store
        self.levels = delay_levels
        self.clock = clock
        self.on_put = on_put  # (topic, queue) -> wake held pulls
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.skipped = 0  # schedule records skipped as undeliverable (module doc)
        self.on_group_topic: Callable[[str], None] | None = None  # a retry topic created
        # in a broker group: True while this broker may not write (a follower)
        self.paused: Callable[[], bool] | None = None
        # schedule queues whose first move since the start (or since this broker led its
        # group) has been checked against its target (``_move``)
        self._checked: set[tuple[str, int]] = set()
        self._wake_at_ms = 0  # when the service wakes up next (delayed sends before it wake it)

    # ---------------------------------------------------------------- topics
    def ensure_topics(self) -> None:
        """Create (or grow) the schedule topic: one queue per delay level."""
        t = self.store.topics.get(SCHEDULE_TOPIC)
        if t is None or t.queues < len(self.levels):
            self.store.create_topic(SCHEDULE_TOPIC, len(self.levels))

    def ensure_group_topics(self, group: str) -> None:
        """Create the group's retry topic at its first send-back (not before: a group that
        never fails a message has none); ``on_group_topic(group)`` tells its members."""
        if retry_topic(group) not in self.store.topics:
            self.store.create_topic(retry_topic(group), 1)
            if self.on_group_topic is not None:
                self.on_group_topic(group)

    # ---------------------------------------------------------------- send back
    def send_back(self, group: str, topic: str, queue: int, offset: int, delay_level: int,
                  max_reconsume: int, reason: str = "") -> SendBackReply:
        """Store the retry (or dead letter) of the message at (topic, queue, offset).

        A dead letter carries why it is one in its ``DLQ_REASON`` property: ``reason`` (the
        consumer's, e.g. its idempotency layer parking an ambiguous outcome), else the
        retries being used up."""
        if len(reason) > MAX_DLQ_REASON:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                             f"dlq_reason longer than {MAX_DLQ_REASON} characters")
        m = self._read(topic, queue, offset, "message")
        props = dict(m.properties)
        for k in (PROP_REAL_TOPIC, PROP_REAL_QUEUE, PROP_DELIVER_AT, PROP_DLQ_REASON):
            props.pop(k, None)
        if not topic.startswith(RETRY_PREFIX):
            props[PROP_ORIGIN_TOPIC] = topic
            props[PROP_ORIGIN_QUEUE] = str(queue)
            props[PROP_ORIGIN_OFFSET] = str(offset)
        # the count saturates: a message at the largest count has no retry left
        at_limit = m.reconsume_times >= MAX_RECONSUME_TIMES
        recons = min(m.reconsume_times + 1, MAX_RECONSUME_TIMES)
        if delay_level < 0 or recons > max_reconsume or at_limit:
            dlq = dlq_topic(group)
            if dlq not in self.store.topics:
                self.store.create_topic(dlq, 1)
            props[PROP_DLQ_REASON] = reason or (
                "sent to the DLQ by the consumer" if delay_level < 0 else
                f"reconsume count at its limit ({MAX_RECONSUME_TIMES})" if at_limit else
                f"retries used up ({recons - 1} of at most {max_reconsume})")
            self._put(dlq, 0, m, props, recons)
            log.info("message %s of group %s moved to %s after %d retries", m.unique_key,
                     group, dlq, recons - 1)
            return SendBackReply(dlq=True, reconsume=recons)
        self.ensure_group_topics(group)
        self.ensure_topics()
        level = retry_level(m.reconsume_times, delay_level, len(self.levels))
        due = int((self.clock() + self.levels[level - 1]) * 1000)
        props[PROP_REAL_TOPIC] = retry_topic(group)
        props[PROP_REAL_QUEUE] = "0"
        props[PROP_DELIVER_AT] = str(due)
        self._put(SCHEDULE_TOPIC, level - 1, m, props, recons)
        self._wake.set()
        return SendBackReply(dlq=False, reconsume=recons, level=level)

    def resend_dead_letter(self, group: str, offset: int) -> PutResult:
        """Store the dead letter at ``offset`` of ``%DLQ%<group>`` in the group's retry
        topic at once (``onceq dlq resend``): only this group consumes it again, and its
        consumers see the origin topic as the message's topic.

        The copy keeps the unique key, the properties and the reconsume count. The dedup
        window keys on (topic, unique key, reconsume count): a resend is not mistaken for
        a producer retry of the original message, and the same dead letter resent twice
        within the window is stored once (answered as a duplicate). With its count kept,
        a resent message that fails again goes straight back to the dead-letter queue."""
        dlq = dlq_topic(group)
        m = self._read(dlq, 0, offset, f"dead letter of group {group!r}")
        origin = m.properties.get(PROP_ORIGIN_TOPIC)
        if not isinstance(origin, str) or not origin or origin.startswith(RETRY_PREFIX):
            raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                             f"dead letter {dlq}[0]@{offset}: no origin topic in its "
                             "properties")
        self.ensure_group_topics(group)
        return self._put(retry_topic(group), 0, m, dict(m.properties), m.reconsume_times)

    def _read(self, topic: str, queue: int, offset: int, what: str) -> MessageExt:
        r = self.store.get(topic, queue, offset, 1, 64 * 1024 * 1024)
        m = next(decode_records(r.payload, True, offset, offset + 1), None
                 ) if r.status == PullStatus.FOUND else None
        if m is None or m.queue_offset != offset:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                             f"no {what} at {topic}[{queue}]@{offset}")
        return m

    def _put(self, topic: str, queue: int, m: MessageExt, props: dict, recons: int,
             dedup: bool | None = None) -> PutResult:
        # a copy is never a writer's sequence: without the flag, the replay of the log
        # does not take it for one (retry, dead letter, or due for the real topic)
        part = encode_part(m.body, m.unique_key, m.born_ts_ms, m.tags, m.keys, props,
                           m.flags & ~(SEQUENCED | DELAYED), recons)
        # the schedule topic is shared by all groups: dedup there would merge two groups'
        # retries of one message; a retry or dead-letter topic belongs to one group
        if dedup is None:
            dedup = topic != SCHEDULE_TOPIC
        res = self.store.put(topic, queue, [part], dedup=dedup)
        self.on_put(topic, queue)
        return res


    # ---------------------------------------------------------------- delayed sends
    def ensure_timer_topic(self) -> None:
        """Create the timer topic at the first delayed send: one queue per timer level."""
        t = self.store.topics.get(TIMER_TOPIC)
        if t is None or t.queues < TIMER_LEVELS:
            self.store.create_topic(TIMER_TOPIC, TIMER_LEVELS)

    def send_delayed(self, topic: str, queue: int, part: bytes | memoryview,
                     max_delay_s: float) -> PutResult:
        """Store a producer's delayed message (its part carries the ``DELAYED`` flag) for
        ``topic`` queue ``queue`` in the timer queue for its delay (``log/delay.py``);
        durable like any send once the put's end is flushed. The dedup window applies to
        its unique key in the timer topic: a producer retry is answered as a duplicate.
        Raises INVALID_ARGUMENT for a delivery time that is missing or too far ahead."""
        try:
            props, fields = _part_fields(part)
            deliver_ms = parse_deliver_ms(props.get(PROP_TIMER_DELIVER_MS))
            now_ms = int(self.clock() * 1000)
            check_delay(deliver_ms, now_ms, max_delay_s)
        except (DelayError, RecordError) as exc:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
        self.store.topics.queue(topic, queue)  # the target queue exists
        props[PROP_REAL_TOPIC] = topic
        props[PROP_REAL_QUEUE] = str(queue)
        body, key, born, tags, keys, flags, recons = fields
        level = timer_level(deliver_ms - now_ms)
        self.ensure_timer_topic()
        try:
            stored = encode_part(body, key, born, tags, keys, props,
                                 flags & ~(SEQUENCED | DELAYED), recons)
        except RecordError as exc:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, f"delayed message: {exc}") from None
        res = self.store.put(TIMER_TOPIC, level, [stored], dedup=True)
        self.on_put(TIMER_TOPIC, level)
        if not res.duplicates:
            due = timer_due(self.store.appender.last_store_ms, level, deliver_ms)[0]
            if due < self._wake_at_ms:  # the service sleeps past it: wake it now
                self._wake.set()
        return res

    # ---------------------------------------------------------------- schedule service
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="onceq-schedule")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _sources(self) -> list[tuple[str, int]]:
        """The schedule queues: every queue of ``%SCHEDULE%`` (not just one per configured
        level: after a restart with fewer delay levels the higher queues still hold
        retries) and of ``%TIMER%``."""
        out = []
        for name in (SCHEDULE_TOPIC, TIMER_TOPIC):
            t = self.store.topics.get(name)
            if t is not None:
                out.extend((name, q) for q in range(t.queues))
        return out

    def deliver_due(self) -> float:
        """Move every due message to its target, in due-time order over all the schedule
        queues; return seconds until the next is due. No record stops a queue, and no
        queue the others (module doc)."""
        now_ms = int(self.clock() * 1000)
        heads: list[tuple[int, int, _Due]] = []  # (due, tie, the queue's head)
        waits = [float("inf")]
        for n, (topic, queue) in enumerate(self._sources()):
            try:
                head = self._next_due(topic, queue, self._records(topic, queue))
            except Exception as exc:  # e.g. a read error: this queue is tried again
                self._queue_failed(topic, queue, exc)
                waits.append(1.0)
                continue
            if head is not None:
                heapq.heappush(heads, (head.due, n, head))
        while heads and heads[0][0] <= now_ms:
            _due, n, head = heapq.heappop(heads)
            try:
                wait = self._move(head, now_ms)
                if wait is not None:  # the store cannot take it now: this queue waits
                    waits.append(wait)
                    continue
                self.store.commit_offset(SCHEDULE_GROUP, head.topic, head.queue,
                                         head.m.queue_offset + 1)
                if head.hop_due is not None:
                    waits.append(max(head.hop_due - now_ms, 0) / 1000)
                head = self._next_due(head.topic, head.queue, head.rest)
            except Exception as exc:
                self._queue_failed(head.topic, head.queue, exc)
                waits.append(1.0)
                continue
            if head is not None:
                heapq.heappush(heads, (head.due, n, head))
        if heads:
            waits.append((heads[0][0] - now_ms) / 1000)
        return min(waits)

    def _queue_failed(self, topic: str, queue: int, exc: Exception) -> None:
        self.store.errors.error(f"schedule-{topic}-{queue}", "schedule service: %s[%d] "
                                "failed (%r); retrying in a second", topic, queue, exc)

    def _level_delay_ms(self, queue: int) -> int:
        delay = self.levels[queue] if queue < len(self.levels) else max(self.levels)
        return math.ceil(delay * 1000)

    def _records(self, topic: str, queue: int) -> Iterator[MessageExt]:
        """The records of a schedule queue from its progress on; records that cannot be
        read are skipped (damaged ones are lost) and the progress moves past them."""
        store = self.store
        offset = max(store.get_offset(SCHEDULE_GROUP, topic, queue), 0)
        while True:
            r = store.get(topic, queue, offset, _READ_AHEAD, 16 * 1024 * 1024)
            if r.status in (PullStatus.OFFSET_MOVED, PullStatus.DAMAGED):
                if r.next_offset <= offset:
                    return
                offset = r.next_offset  # damaged (or deleted) records are lost: skip them
                store.commit_offset(SCHEDULE_GROUP, topic, queue, offset)
                continue
            if r.status != PullStatus.FOUND:
                return
            records = decode_records(r.payload, True, offset, r.next_offset)
            while True:
                try:
                    m = next(records, None)
                except RecordError as exc:  # records of a pull have consecutive offsets
                    self._skip(topic, queue, offset, "", exc)
                    offset += 1
                    store.commit_offset(SCHEDULE_GROUP, topic, queue, offset)
                    break  # read again after it
                if m is None:
                    break
                yield m
                offset = m.queue_offset + 1

    def _next_due(self, topic: str, queue: int, rest: Iterator[MessageExt]) -> _Due | None:
        """The next record of a queue that can be delivered (undeliverable ones are
        skipped, counted and passed), with its due time; None when there is none."""
        for m in rest:
            try:
                if topic == SCHEDULE_TOPIC:
                    due, target = scheduled_delivery(m, self._level_delay_ms(queue))
                    return _Due(topic, queue, m, rest, due, target, 0, True)
                deliver_ms, target, tq = timer_delivery(m)
                due, deliver = timer_due(m.store_ts_ms, queue, deliver_ms)
                return _Due(topic, queue, m, rest, due, target, tq, deliver, deliver_ms)
            except BadScheduled as exc:
                self._skip(topic, queue, m.queue_offset, m.unique_key, exc)
                self.store.commit_offset(SCHEDULE_GROUP, topic, queue, m.queue_offset + 1)
        return None

    def _move(self, head: _Due, now_ms: int) -> float | None:
        """Move a due record on: to its target (the group's retry topic, a delayed
        message's topic and queue), or, for a delayed message whose time has not come, to
        the timer queue for the time it has left. None when done with it (moved, or
        skipped), else seconds to wait before trying it again (the store refuses writes
        now): its queue waits, nothing is dropped.

        The first move of each queue after a start (or after this broker became its
        group's leader) first looks for the record's copy in its target: a process killed
        between a move and the progress commit that follows it left at most that one
        record moved without its progress (``_moved_before``)."""
        m = head.m
        props = dict(m.properties)
        if head.topic == TIMER_TOPIC and not head.deliver and head.deliver_ms > now_ms:
            target, tq = TIMER_TOPIC, timer_level(head.deliver_ms - now_ms)
            dedup = False  # the same message, moved on: not a producer's retry
            head.hop_due = now_ms + level_ms(tq)
        else:
            target, tq = head.target, head.target_queue
            for k in (PROP_REAL_TOPIC, PROP_REAL_QUEUE, PROP_DELIVER_AT):
                props.pop(k, None)
            dedup = True
            if target not in self.store.topics or target in self.store.topics.deleting:
                log.warning("dropping scheduled message %s: topic %r is gone", m.unique_key,
                            target)
                return None
        key = (head.topic, head.queue)
        if key not in self._checked:
            self._checked.add(key)
            for where, q in _copies(head, now_ms):
                if self._moved_before(m, where, q):
                    log.info("schedule service: %s[%d]@%d (unique key %s) was moved to "
                             "%s[%d] before the restart; not moved again", head.topic,
                             head.queue, m.queue_offset, m.unique_key, where, q)
                    return None
        try:
            self._put(target, tq, m, props, m.reconsume_times, dedup)
        except (OnceqError, StorageError) as exc:
            if not exc.retriable:
                self._skip(head.topic, head.queue, m.queue_offset, m.unique_key, exc)
                return None
            # a full disk (or writes stopped): try again later, drop nothing
            self.store.errors.warning("retry-deliver", "cannot deliver scheduled messages "
                                      "now: %s", exc)
            self._checked.discard(key)
            return 1.0
        except Exception as exc:  # one bad message must not stop every one behind it
            self._skip(head.topic, head.queue, m.queue_offset, m.unique_key, exc)
        return None

    def _moved_before(self, m: MessageExt, target: str, queue: int) -> bool:
        """Whether the copy of schedule record ``m`` is in ``target[queue]`` already: a
        record stored after ``m`` (further in the commit log) with its unique key,
        reconsume count, born time, body and delivery time, among the last
        ``RECONCILE_SCAN`` records of the queue."""
        try:
            lo, hi = self.store.min_max(target, queue)
        except StorageError:
            return False
        want = (m.unique_key, m.reconsume_times, m.born_ts_ms, m.body,
                m.properties.get(PROP_TIMER_DELIVER_MS))
        end = hi
        floor = max(lo, hi - RECONCILE_SCAN)
        while end > floor:
            start = max(floor, end - _READ_AHEAD)
            r = self.store.get(target, queue, start, end - start, 16 * 1024 * 1024)
            if r.status != PullStatus.FOUND:
                return False
            try:
                found = list(decode_records(r.payload, True, start, end))
            except RecordError:
                return False
            for c in reversed(found):
                if c.position <= m.position:
                    return False  # stored before the record (or it): no copy of it
                if (c.unique_key, c.reconsume_times, c.born_ts_ms, c.body,
                        c.properties.get(PROP_TIMER_DELIVER_MS)) == want:
                    return True
            end = start
        return False

    def _skip(self, topic: str, queue: int, offset: int, key: str, why: Exception) -> None:
        self.skipped += 1
        self.store.errors.error("schedule-skip", "schedule service: skipped the record at "
                                "%s[%d]@%d (unique key %r), it is not delivered: %s",
                                topic, queue, offset, key, why)

    async def _run(self) -> None:
        while not self._stopping:
            if self.paused is not None and self.paused():
                self._checked.clear()  # a follower: its next move as leader checks first
                self._wake.clear()
                self._wake_at_ms = 0
                await wait_event(self._wake, 1.0)
                continue
            try:
                wait = self.deliver_due()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("schedule service failed; retrying")
                wait = 1.0
            self._wake.clear()
            wait = min(wait, 1.0)
            self._wake_at_ms = int(self.clock() * 1000 + wait * 1000)
            await wait_event(self._wake, wait)


class _Due:
    """The head of a schedule queue in one pass of the service: its record, the rest of
    the queue, when the record is due and where it goes."""

    __slots__ = ("deliver", "deliver_ms", "due", "hop_due", "m", "queue", "rest", "target",
                 "target_queue", "topic")

    def __init__(self, topic: str, queue: int, m: MessageExt, rest: Iterator[MessageExt],
                 due: int, target: str, target_queue: int, deliver: bool,
                 deliver_ms: int = 0) -> None:
        self.topic = topic
        self.queue = queue
        self.m = m
        self.rest = rest
        self.due = due
        self.target = target
        self.target_queue = target_queue
        self.deliver = deliver
        self.deliver_ms = deliver_ms
        self.hop_due: int | None = None  # moved on in the timer: when it is due there

    def __lt__(self, other: _Due) -> bool:  # heap ties are broken before this is asked
        return False


def _copies(head: _Due, now_ms: int) -> list[tuple[str, int]]:
    """Where an earlier process may have moved ``head`` between its due time and now:
    its target, and for a delayed message not delivered at its due time, the timer queues
    for the time it had left at any moment since (the move depends on the time it ran)."""
    if head.topic != TIMER_TOPIC or head.deliver:
        return [(head.target, head.target_queue)]
    d = head.deliver_ms
    out = []
    if d - head.due > 0:
        lo = timer_level(max(d - now_ms, 1))
        out = [(TIMER_TOPIC, q) for q in range(lo, timer_level(d - head.due) + 1)]
    if d <= now_ms:
        out.append((head.target, head.target_queue))
    return out


def timer_delivery(m: MessageExt) -> tuple[int, str, int]:
    """(delivery time in ms, topic, queue) of a timer record; raise BadScheduled for a
    record the service must skip: its target must be a user topic (never a system topic)
    and its times and queue decimal integer strings."""
    props = m.properties
    target = props.get(PROP_REAL_TOPIC)
    if not isinstance(target, str) or target.startswith(SYSTEM_PREFIX) or target == "":
        raise BadScheduled(f"target {str(target)[:140]!r} is not a user topic")
    try:
        check_name("topic", target)
    except StorageError:
        raise BadScheduled(f"target {target[:140]!r} is not a user topic") from None
    queue = _decimal(props, PROP_REAL_QUEUE)
    if queue > 0xFFFF:
        raise BadScheduled(f"target queue {queue} of {target} is out of range")
    try:
        deliver_ms = parse_deliver_ms(props.get(PROP_TIMER_DELIVER_MS))
    except DelayError as exc:
        raise BadScheduled(str(exc)) from None
    return deliver_ms, target, queue


def _part_fields(part: bytes | memoryview
                 ) -> tuple[dict[str, Any], tuple[bytes, str, int, str, str, int, int]]:
    """(properties, (body, unique key, born, tags, keys, flags, reconsume count)) of a
    message part; raises RecordError for one that does not decode."""
    check_part(part)
    born, flags, recons, ulen, tlen, klen, plen, blen = PART_FIXED.unpack_from(part)
    key, tags, keys, props, body = variable_fields(memoryview(part), PART_FIXED_SIZE, ulen,
                                                   tlen, klen, plen, blen)
    return dict(props), (body, key, born, tags, keys, flags, recons)
