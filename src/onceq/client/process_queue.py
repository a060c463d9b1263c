"""Process queue: the in-flight messages of one owned queue (pure, time passed in)."""

from __future__ import annotations

from collections.abc import Iterable

from ..log.record import MessageExt
from .allocation import MessageQueue


class ProcessQueue:
    """Messages pulled from one queue and not yet acknowledged, ordered by offset.

    The offset to commit is the lowest offset still in flight, or the next offset to pull
    when nothing is in flight (filtered messages count as done), so a slow message holds the
    commit back; it only moves forward. Callers set ``next_offset`` after ``add``.
    """

    __slots__ = ("_ack", "_bytes", "_msgs", "confirmed_at", "dropped", "generation",
                 "last_pull", "max_offset", "mq", "next_offset", "released", "stale")

    def __init__(self, mq: MessageQueue, next_offset: int, now: float) -> None:
        self.mq = mq
        self.next_offset = next_offset  # where the next pull starts
        self._msgs: dict[int, MessageExt] = {}  # insertion order == offset order
        self._bytes = 0
        self.max_offset = next_offset - 1  # highest offset ever added
        self._ack = next_offset  # offset to commit (moves forward only)
        self.last_pull = now
        self.dropped = False
        self.released = False  # revoke finished: the next owner has these messages now
        self.stale = False  # the group moved on without it (an offset reset, or the queue
        # was lost while this member was away): nothing of it is committed
        self.generation = 0  # set by the assignment when it takes the queue
        self.confirmed_at: float | None = None
        """When the broker last confirmed this member holds the queue's access lock (the
        send time of a granted pull or of a heartbeat listing it); None: never held, or the
        lock does not apply."""

    # ------------------------------------------------------------ contents
    def add(self, msgs: Iterable[MessageExt]) -> None:
        d = self._msgs
        for m in msgs:
            if m.queue_offset > self.max_offset:
                d[m.queue_offset] = m
                self._bytes += len(m.body)
                self.max_offset = m.queue_offset

    def remove(self, msgs: Iterable[MessageExt]) -> int:
        """Forget acknowledged messages; return the offset to commit."""
        d = self._msgs
        for m in msgs:
            if d.pop(m.queue_offset, None) is not None:
                self._bytes -= len(m.body)
        return self.commit_offset

    def head(self, n: int) -> list[MessageExt]:
        """The ``n`` lowest-offset messages in flight (orderly consumption takes these)."""
        out = []
        for m in self._msgs.values():
            if len(out) == n:
                break
            out.append(m)
        return out

    def rewind(self, offset: int) -> None:
        """Continue at a lower ``offset`` the broker asked for (the queue shrank, e.g. after
        a damaged log was cut back). Only with nothing in flight."""
        assert not self._msgs
        self.next_offset = offset
        self.max_offset = offset - 1
        self._ack = offset

    @property
    def commit_offset(self) -> int:
        """The offset to commit: the lowest one still in flight, else the next to pull.
        (The broker's committed offset is the group's *ack offset*.)"""
        low = next(iter(self._msgs)) if self._msgs else self.next_offset
        if low > self._ack:
            self._ack = low
        return self._ack

    def __len__(self) -> int:
        return len(self._msgs)

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    @property
    def span(self) -> int:
        if not self._msgs:
            return 0
        return self.max_offset - next(iter(self._msgs))

    # ------------------------------------------------------------ policies
    def flow_blocked(self, max_count: int, max_bytes: int, max_span: int) -> str | None:
        """Why pulling must pause now (None: it may pull)."""
        if len(self._msgs) > max_count:
            return "count"
        if self._bytes > max_bytes:
            return "bytes"
        if self.span > max_span:
            return "span"
        return None

    def pull_expired(self, now: float, timeout: float) -> bool:
        """True when this queue has not pulled for ``timeout`` seconds (stalled)."""
        return now - self.last_pull > timeout
