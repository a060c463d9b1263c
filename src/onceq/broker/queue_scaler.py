"""Queues that follow a consumer group, applied: the broker's side of
``queue_scaling.py`` (docs/queue_scaling.md).

The scaler learns a group's size from its membership (``on_members``), and every tick
(``tick``) moves each following topic one step: it ends a change whose grace time is over
(the ends of the queues producers left are fixed now), opens the gates whose parent queues
every reading group has consumed, removes drained queues from reading, and starts a new
write-count change once the group's size has been stable for ``settle_s``. Its state lives
in the topic's entry of the topics table, so a restart resumes where it was.

It also guards sends (``guard``: a queue no longer written refuses them with
``INVALID_QUEUE`` once the grace is over; a producer then fetches the topic again) and
bounds reads (``read_limit``, the pull service's ``visible_end``: a gated queue is read up
to its gate, held pulls wait there and wake when it opens).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import GroupChanged
from ..storage.topics import TopicConfig
from .groups import CLUSTERING
from .queue_scaling import Gate, Layout, ScalingState, decide, moved_from

if TYPE_CHECKING:
    from ..protocol.schema import Message
    from ..storage.store import MessageStore
    from .fields import Call, Handler
    from .groups import GroupRegistry

log = logging.getLogger("onceq.broker")

VisibleEnd = Callable[[str, int], "int | None"]


class QueueScaler:
    """``grace_s``: how long producers may still write with a topic's old write count
    (above their refresh of it); ``settle_s``: how long a group's size must hold before the
    counts follow it; ``start_hold_s``: no change that long after the broker started (the
    members reconnect meanwhile); ``wake(topic, queue)``: retry the pulls held on a queue."""

    def __init__(self, store: MessageStore, groups: GroupRegistry,
                 clock: Callable[[], float], *, grace_s: float, settle_s: float,
                 start_hold_s: float, wake: Callable[[str, int], None]) -> None:
        self.store = store
        self.groups = groups
        self.clock = clock
        self.grace_s = grace_s
        self.settle_s = settle_s
        self.start_hold_s = start_hold_s
        self.wake = wake
        self.started = clock()
        self._sizes: dict[str, tuple[int, float]] = {}  # group -> (members, since)
        self.tick_s = min(0.5, max(settle_s / 4, 0.05))  # how often ``tick`` runs
        self.changes = 0  # write-count changes started (a metric)
        self.removed = 0  # queues removed from reading once drained

    # ---------------------------------------------------------------- hooks
    def on_members(self, group: str) -> None:
        """The membership of ``group`` changed: its size is taken from now on."""
        n = self.size(group)
        if self._sizes.get(group, (None, 0.0))[0] != n:
            self._sizes[group] = (n, self.clock())

    def size(self, group: str) -> int:
        return sum(1 for m in self.groups.members(group) if m.model == CLUSTERING)

    def guard(self, handlers: dict[type[Message], Handler], *kinds: type[Message]) -> None:
        """Wrap the send handlers of ``kinds`` in ``handlers``: refuse sends to a queue the
        topic no longer writes."""
        for kind in kinds:
            handlers[kind] = self._guarded(handlers[kind])

    def _guarded(self, handler: Handler) -> Handler:
        def guarded(call: Call, req: Any) -> Any:
            self.check_write(req.topic, req.queue)
            return handler(call, req)
        return guarded

    def check_write(self, topic: str, queue: int) -> None:
        t: TopicConfig | None = self.store.topics.get(topic)
        if t is None or t.write_queues is None or not isinstance(queue, int):
            return
        limit = t.write_queues
        st = t.scaling
        if st is not None and st.get("grace_until_ms"):
            limit = max(limit, st.get("grace_from", 0))
        if limit <= queue < t.queues:
            raise OnceqError(ErrorCode.INVALID_QUEUE, (
                f"queue {queue} of topic {topic!r} takes no more writes: the topic writes "
                f"queues 0..{t.write_queues - 1} (fetch the topic again)"))

    def read_limit(self, inner: VisibleEnd | None) -> VisibleEnd:
        """The pull service's ``visible_end``: ``inner``'s, lowered to the first gated
        offset of a queue."""
        topics = self.store.topics

        def visible_end(topic: str, queue: int) -> int | None:
            end = None if inner is None else inner(topic, queue)
            t = topics.get(topic)
            if t is None or not t.scaling:
                return end
            gates = t.scaling["gates"].get(str(queue))
            if not gates:
                return end
            start = min(g["start"] for g in gates)
            return start if end is None else min(start, end)
        return visible_end

    # ---------------------------------------------------------------- following
    def follow(self, topic: str, group: str | None, lo: int, hi: int,
               key_order: bool = True) -> TopicConfig:
        """Make ``topic`` follow ``group`` (None: freeze its counts) within ``lo..hi``
        write queues; the first step is taken at once."""
        t = self.store.get_topic(topic)
        if not 1 <= lo <= hi:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                             f"queue bounds must be 1 <= min <= max (got {lo}..{hi})")
        st = self._state(t) or ScalingState(group, lo, hi, key_order)
        st.group, st.lo, st.hi, st.key_order = group, lo, hi, key_order
        if not key_order:
            st.gates.clear()
        t = self.store.topics.set_layout(topic, t.readable, t.writable, st.to_json())
        if group is not None and group not in self._sizes:
            self._sizes[group] = (self.size(group), self.clock() - self.settle_s)
        self._step(t, self.clock(), first=True)
        return self.store.get_topic(topic)

    def tick(self) -> None:
        now = self.clock()
        for t in list(self.store.topics.values()):
            if t.scaling:
                self._step(t, now)

    def _state(self, t: TopicConfig) -> ScalingState | None:
        if not t.scaling:
            return None
        try:
            return ScalingState.from_json(t.scaling)
        except ValueError as exc:
            log.error("topic %s: scaling state ignored: %s", t.name, exc)
            return None

    def readers(self, topic: str) -> set[str]:
        """The groups that read ``topic``: its live CLUSTERING members' groups, and every
        group with a committed offset on it."""
        out = {g for g, members in self.groups.groups.items()
               if any(m.model == CLUSTERING and topic in m.subscriptions
                      for m in members.values())}
        out.update(g for g, topics in self.store.offsets.groups.items() if topic in topics)
        return out

    def behind(self, readers: set[str], topic: str, queue: int, end: int) -> list[str]:
        """The groups of ``readers`` that have not consumed ``queue`` up to ``end``."""
        lo, _hi = self.store.min_max(topic, queue)
        if end <= lo:
            return []  # nothing left below it to read
        return sorted(g for g in readers if self.store.get_offset(g, topic, queue) < end)

    def _step(self, t: TopicConfig, now: float, first: bool = False) -> None:
        st = self._state(t)
        if st is None:
            return
        name = t.name
        dirty = False
        if st.grace_until_ms and now * 1000 >= st.grace_until_ms:
            self._end_grace(name, st)
            dirty = True
        readers = self.readers(name)
        opened = []
        for q, gates in list(st.gates.items()):
            left = [g for g in gates if None in g.parents.values() or any(
                self.behind(readers, name, i, p) for i, p in g.parents.items()
                if p is not None)]
            if len(left) < len(gates):
                dirty = True
                opened.append(q)
                if left:
                    st.gates[q] = left
                else:
                    del st.gates[q]
        drained = {q for q, p in st.drains.items()
                   if p is not None and not self.behind(readers, name, q, p)}
        current = Layout(t.readable, t.writable)
        changing = bool(st.grace_until_ms) or st.group is None
        members = 0
        if st.group is not None:
            members, since = self._sizes.get(st.group, (self.size(st.group), now))
            settling = now - since < self.settle_s or now - self.started < self.start_hold_s
            changing = changing or (settling and not first)
        new = decide(members=members, current=current, lo=st.lo, hi=st.hi,
                     changing=changing, drained=drained)
        if new.write != current.write:
            self._start_change(name, st, current.write, new, now)
            dirty = True
        for q in range(new.read, current.read):
            st.drains.pop(q, None)
            st.gates.pop(q, None)
            self.removed += 1
        if dirty or new != current:
            if new.read > t.queues:
                self.store.create_topic(name, new.read)
            self.store.topics.set_layout(name, new.read, new.write, st.to_json())
            log.info("topic %s: reads %d queues, writes %d%s", name, new.read, new.write,
                     f" (draining {sorted(st.drains)})" if st.drains else "")
        if new.read != current.read:
            self._tell_readers(name, readers)
        for q in opened:
            self.wake(name, q)

    def _start_change(self, name: str, st: ScalingState, old: int, new: Layout,
                      now: float) -> None:
        """The write count goes from ``old`` to ``new.write``: producers may use the old
        count for ``grace_s`` more; the queues left are drained; with key order, each queue
        receiving moved keys waits, from its end now, for the queues they come from."""
        self.changes += 1
        st.grace_until_ms = int((now + self.grace_s) * 1000)
        st.grace_from = old
        for q in list(st.drains):
            if q < new.write:  # written again
                del st.drains[q]
        for q in range(new.write, new.read):
            st.drains.setdefault(q, None)
        if st.key_order:
            t = self.store.topics.get(name)
            for q, parents in moved_from(old, new.write).items():
                start = self.store.min_max(name, q)[1] if t is not None and q < t.queues else 0
                st.gates.setdefault(q, []).append(Gate(start, dict.fromkeys(parents)))

    def _end_grace(self, name: str, st: ScalingState) -> None:
        """The grace is over: no producer writes with the old count any more; the ends of
        the queues it wrote are final."""
        st.grace_until_ms = 0
        st.grace_from = 0

        def end(q: int) -> int:
            return self.store.min_max(name, q)[1]
        for q, p in st.drains.items():
            if p is None:
                st.drains[q] = end(q)
        for gates in st.gates.values():
            for g in gates:
                for i, p in g.parents.items():
                    if p is None:
                        g.parents[i] = end(i)

    def _tell_readers(self, topic: str, readers: set[str]) -> None:
        """The read count changed: the reading groups' members rebalance."""
        for g in sorted(readers):
            for m in self.groups.members(g):
                m.conn.push(GroupChanged(g, "", f"queues of {topic}"))

    # ---------------------------------------------------------------- status
    def status(self, topic: str) -> dict[str, Any] | None:
        """What ``TOPIC_STATUS`` shows of a following topic: counts, draining queues and
        who they wait for, gates."""
        t = self.store.topics.get(topic)
        st = None if t is None else self._state(t)
        if t is None or st is None:
            return None
        readers = self.readers(topic)
        now_ms = self.clock() * 1000

        def waiting(q: int, end: int | None) -> list[str]:
            return ["(grace)"] if end is None else self.behind(readers, topic, q, end)
        return {
            "group": st.group, "min": st.lo, "max": st.hi, "key_order": st.key_order,
            "members": None if st.group is None else self.size(st.group),
            "read": t.readable, "write": t.writable, "queues": t.queues,
            "grace_left_s": max(0.0, (st.grace_until_ms - now_ms) / 1000)
            if st.grace_until_ms else 0.0,
            "draining": [{"queue": q, "end": p, "waiting": waiting(q, p)}
                         for q, p in sorted(st.drains.items())],
            "gates": [{"queue": q, "start": g.start,
                       "parents": [{"queue": i, "end": p, "waiting": waiting(i, p)}
                                   for i, p in sorted(g.parents.items())]}
                      for q, gs in sorted(st.gates.items()) for g in gs],
            "changes": self.changes, "removed": self.removed,
        }
