"""Retries and dead letters: consumer send-back, delay levels, the schedule service.

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
  moved again after a crash (its progress not yet saved) is recognised by the dedup window
  when the restart comes within the window (120 s by default), else delivered twice.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
from collections.abc import Callable

from .._aio import wait_event
from ..log.record import MessageExt, RecordError, decode_records, encode_part
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
_MAX_DIGITS = 18  # a due time in ms (an i64 holds 18 decimal digits whatever they are)


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
    value = props.get(name)
    if (not isinstance(value, str) or not value.isascii() or not value.isdigit()
            or len(value) > _MAX_DIGITS):
        raise BadScheduled(f"{name} is not a decimal integer: {str(value)[:40]!r}")
    return int(value)


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

    def _put(self, topic: str, queue: int, m: MessageExt, props: dict, recons: int
             ) -> PutResult:
        # a copy is never a writer's sequence: without the flag, the replay of the log
        # does not take it for one (retry, dead letter, or due for the real topic)
        part = encode_part(m.body, m.unique_key, m.born_ts_ms, m.tags, m.keys, props,
                           m.flags & ~SEQUENCED, recons)
        # the schedule topic is shared by all groups: dedup there would merge two groups'
        # retries of one message; a retry or dead-letter topic belongs to one group
        res = self.store.put(topic, queue, [part], dedup=topic != SCHEDULE_TOPIC)
        self.on_put(topic, queue)
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

    def deliver_due(self) -> float:
        """Move every due message to its retry topic; return seconds until the next is
        due. No record stops a level, and no level the others (module doc)."""
        now_ms = int(self.clock() * 1000)
        next_due = float("inf")
        schedule = self.store.topics.get(SCHEDULE_TOPIC)
        if schedule is None:
            return next_due
        # every queue of the topic, not just one per configured level: after a restart with
        # fewer delay levels the higher queues still hold retries, which would otherwise
        # never be delivered
        for level in range(schedule.queues):
            try:
                wait = self._deliver_level(level, now_ms)
            except Exception as exc:  # e.g. a read error: this level is tried again
                self.store.errors.error(f"schedule-level-{level}", "schedule service: level "
                                        "%d failed (%r); retrying in a second", level + 1,
                                        exc)
                wait = 1.0
            next_due = min(next_due, wait)
        return next_due

    def _level_delay_ms(self, queue: int) -> int:
        delay = self.levels[queue] if queue < len(self.levels) else max(self.levels)
        return math.ceil(delay * 1000)

    def _deliver_level(self, level: int, now_ms: int) -> float:
        """Deliver the due records of one schedule queue and save its progress; return
        seconds until its head is due (inf: empty)."""
        store = self.store
        delay_ms = self._level_delay_ms(level)
        start = offset = max(store.get_offset(SCHEDULE_GROUP, SCHEDULE_TOPIC, level), 0)
        wait = float("inf")
        try:
            while wait == float("inf"):
                r = store.get(SCHEDULE_TOPIC, level, offset, 64, 16 * 1024 * 1024)
                if r.status in (PullStatus.OFFSET_MOVED, PullStatus.DAMAGED):
                    offset = r.next_offset  # damaged retries are lost: skip them
                    continue
                if r.status != PullStatus.FOUND:
                    break
                records = decode_records(r.payload, True, offset, r.next_offset)
                while True:
                    try:
                        m = next(records, None)
                    except RecordError as exc:  # records of a pull have consecutive offsets
                        self._skip(level, offset, "", exc)
                        offset += 1
                        break  # read again after it
                    if m is None:
                        break
                    wait = self._deliver_one(m, level, delay_ms, now_ms)
                    if wait != float("inf"):
                        break
                    offset = m.queue_offset + 1
        finally:
            if offset != start:
                store.commit_offset(SCHEDULE_GROUP, SCHEDULE_TOPIC, level, offset)
        return wait

    def _deliver_one(self, m: MessageExt, level: int, delay_ms: int, now_ms: int) -> float:
        """Deliver ``m`` if due, or skip it; inf when done with it, else the seconds to
        wait before trying it again (not due yet, or the store refuses writes now)."""
        try:
            due, target = scheduled_delivery(m, delay_ms)
        except BadScheduled as exc:
            self._skip(level, m.queue_offset, m.unique_key, exc)
            return float("inf")
        if due > now_ms:
            return (due - now_ms) / 1000
        props = dict(m.properties)
        for k in (PROP_REAL_TOPIC, PROP_REAL_QUEUE, PROP_DELIVER_AT):
            props.pop(k, None)
        if target not in self.store.topics:
            log.warning("dropping scheduled message %s: topic %r is gone", m.unique_key,
                        target)
            return float("inf")
        try:
            self._put(target, 0, m, props, m.reconsume_times)
        except (OnceqError, StorageError) as exc:
            if not exc.retriable:
                self._skip(level, m.queue_offset, m.unique_key, exc)
                return float("inf")
            # a full disk (or writes stopped): try again later, drop nothing
            self.store.errors.warning("retry-deliver", "cannot deliver scheduled retries "
                                      "now: %s", exc)
            return 1.0
        except Exception as exc:  # one bad message must not stop every retry behind it
            self._skip(level, m.queue_offset, m.unique_key, exc)
        return float("inf")

    def _skip(self, level: int, offset: int, key: str, why: Exception) -> None:
        self.skipped += 1
        self.store.errors.error("schedule-skip", "schedule service: skipped the record at "
                                "%s[%d]@%d (unique key %r), it is not delivered: %s",
                                SCHEDULE_TOPIC, level, offset, key, why)

    async def _run(self) -> None:
        while not self._stopping:
            if self.paused is not None and self.paused():
                self._wake.clear()
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
            await wait_event(self._wake, min(wait, 1.0))
