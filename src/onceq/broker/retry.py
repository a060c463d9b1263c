"""Retries and dead letters: consumer send-back, delay levels, the schedule service.

A failed message is sent back by the consumer with (topic, queue, offset). The broker
re-reads it and stores a copy with reconsume_times + 1 and the same unique key:

* into ``%DLQ%<group>`` when the count passes the group's maximum (nobody consumes it
  automatically; ``onceq dlq resend`` puts messages back);
* otherwise into the schedule topic, queue ``level - 1``, with the real destination
  (``%RETRY%<group>``) and the due time in its properties. Each delay level has a fixed
  delay, so every schedule queue is in due-time order and the schedule service only has to
  watch its head. Its progress is kept as the offsets of the ``%SCHEDULE%`` group, saved
  with the other consumer offsets, so delayed messages survive a restart; a message
  moved again after a crash (its progress not yet saved) is recognised by the dedup window
  when the restart comes within the window (120 s by default), else delivered twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable

from .._aio import wait_event
from ..log.record import MessageExt, decode_records, encode_part
from ..log.sequence import SEQUENCED
from ..protocol.codes import (
    MAX_DLQ_REASON,
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
from ..storage.store import MessageStore

log = logging.getLogger("onceq.broker")

DEFAULT_DELAY_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
SCHEDULE_GROUP = "%SCHEDULE%"
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


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

    # ---------------------------------------------------------------- topics
    def ensure_topics(self) -> None:
        """Create (or grow) the schedule topic: one queue per delay level."""
        t = self.store.topics.get(SCHEDULE_TOPIC)
        if t is None or t.queues < len(self.levels):
            self.store.create_topic(SCHEDULE_TOPIC, len(self.levels))

    def ensure_group_topics(self, group: str) -> None:
        if retry_topic(group) not in self.store.topics:
            self.store.create_topic(retry_topic(group), 1)

    # ---------------------------------------------------------------- send back
    def send_back(self, group: str, topic: str, queue: int, offset: int, delay_level: int,
                  max_reconsume: int, reason: str = "") -> dict:
        """Store the retry (or dead letter) of the message at (topic, queue, offset).

        A dead letter carries why it is one in its ``DLQ_REASON`` property: ``reason`` (the
        consumer's, e.g. its idempotency layer parking an ambiguous outcome), else the
        retries being used up."""
        if len(reason) > MAX_DLQ_REASON:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                             f"dlq_reason longer than {MAX_DLQ_REASON} characters")
        r = self.store.get(topic, queue, offset, 1, 64 * 1024 * 1024)
        if r.status != PullStatus.FOUND or not r.count:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                             f"no message at {topic}[{queue}]@{offset}")
        m = next(decode_records(r.payload))
        if m.queue_offset != offset:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                             f"no message at {topic}[{queue}]@{offset}")
        props = dict(m.properties)
        for k in (PROP_REAL_TOPIC, PROP_REAL_QUEUE, PROP_DELIVER_AT, PROP_DLQ_REASON):
            props.pop(k, None)
        if not topic.startswith(RETRY_PREFIX):
            props[PROP_ORIGIN_TOPIC] = topic
            props[PROP_ORIGIN_QUEUE] = str(queue)
            props[PROP_ORIGIN_OFFSET] = str(offset)
        recons = m.reconsume_times + 1
        if delay_level < 0 or recons > max_reconsume:
            dlq = dlq_topic(group)
            if dlq not in self.store.topics:
                self.store.create_topic(dlq, 1)
            props[PROP_DLQ_REASON] = reason or (
                "sent to the DLQ by the consumer" if delay_level < 0 else
                f"retries used up ({recons - 1} of at most {max_reconsume})")
            self._put(dlq, 0, m, props, recons)
            log.info("message %s of group %s moved to %s after %d retries", m.unique_key,
                     group, dlq, recons - 1)
            return {"dlq": True, "reconsume": recons}
        self.ensure_group_topics(group)
        self.ensure_topics()
        level = retry_level(m.reconsume_times, delay_level, len(self.levels))
        due = int((self.clock() + self.levels[level - 1]) * 1000)
        props[PROP_REAL_TOPIC] = retry_topic(group)
        props[PROP_REAL_QUEUE] = "0"
        props[PROP_DELIVER_AT] = str(due)
        self._put(SCHEDULE_TOPIC, level - 1, m, props, recons)
        self._wake.set()
        return {"dlq": False, "reconsume": recons, "level": level}

    def _put(self, topic: str, queue: int, m: MessageExt, props: dict, recons: int) -> None:
        # a copy is never a writer's sequence: without the flag, the replay of the log
        # does not take it for one (retry, dead letter, or due for the real topic)
        part = encode_part(m.body, m.unique_key, m.born_ts_ms, m.tags, m.keys, props,
                           m.flags & ~SEQUENCED, recons)
        # the schedule topic is shared by all groups: dedup there would merge two groups'
        # retries of one message; a retry or dead-letter topic belongs to one group
        self.store.put(topic, queue, [part], dedup=topic != SCHEDULE_TOPIC)
        self.on_put(topic, queue)

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
        """Move every due message to its real topic; return seconds until the next is due."""
        now_ms = int(self.clock() * 1000)
        next_due = float("inf")
        store = self.store
        schedule = store.topics.get(SCHEDULE_TOPIC)
        if schedule is None:
            return next_due
        # every queue of the topic, not just one per configured level: after a restart with
        # fewer delay levels the higher queues still hold retries (each carries its due
        # time), which would otherwise never be delivered
        for level in range(schedule.queues):
            start = offset = max(store.get_offset(SCHEDULE_GROUP, SCHEDULE_TOPIC, level), 0)
            while True:
                r = store.get(SCHEDULE_TOPIC, level, offset, 64, 16 * 1024 * 1024)
                if r.status in (PullStatus.OFFSET_MOVED, PullStatus.DAMAGED):
                    offset = r.next_offset  # damaged retries are lost: skip them
                    continue
                if r.status != PullStatus.FOUND:
                    break
                stop = False
                for m in decode_records(r.payload):
                    try:
                        due = int(m.properties.get(PROP_DELIVER_AT, "0"))
                    except ValueError:
                        due = 0  # unreadable due time: deliver (or drop) it now
                    if due > now_ms:
                        next_due = min(next_due, (due - now_ms) / 1000)
                        stop = True
                        break
                    try:
                        self._deliver(m)
                    except OnceqError as exc:
                        if exc.retriable:
                            # a full disk (or writes stopped): try again later, drop nothing
                            store.errors.warning("retry-deliver", "cannot deliver scheduled "
                                                 "retries now: %s", exc)
                            next_due = min(next_due, 1.0)
                            stop = True
                            break
                        log.error("dropping scheduled message %s at %s[%d]@%d: %s",
                                  m.unique_key, SCHEDULE_TOPIC, level, m.queue_offset, exc)
                    except Exception:  # one bad message must not stop every retry behind it
                        log.exception("dropping scheduled message %s at %s[%d]@%d: it cannot "
                                      "be delivered", m.unique_key, SCHEDULE_TOPIC, level,
                                      m.queue_offset)
                    offset = m.queue_offset + 1
                if stop:
                    break
            if offset != start:
                store.commit_offset(SCHEDULE_GROUP, SCHEDULE_TOPIC, level, offset)
        return next_due

    def _deliver(self, m: MessageExt) -> None:
        props = dict(m.properties)
        topic = props.pop(PROP_REAL_TOPIC, "")
        queue = int(props.pop(PROP_REAL_QUEUE, "0"))
        props.pop(PROP_DELIVER_AT, None)
        if topic not in self.store.topics:
            log.warning("dropping scheduled message %s: topic %r is gone", m.unique_key, topic)
            return
        self._put(topic, queue, m, props, m.reconsume_times)

    async def _run(self) -> None:
        while not self._stopping:
            try:
                wait = self.deliver_due()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("schedule service failed; retrying")
                wait = 1.0
            self._wake.clear()
            await wait_event(self._wake, min(wait, 1.0))
