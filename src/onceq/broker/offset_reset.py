"""Explicit offset resets (``RESET_OFFSETS``), and the fence that makes a forced one stick.

Moving a group's offsets (back, or anywhere) is an admin operation. It is refused with
``GROUP_ACTIVE`` while the group has live members, unless forced. A forced reset must win
over the running members, which keep their own positions in memory:

1. the broker drops the group's access locks and deliver offsets on the reset queues,
   answers their held pulls ``LOCKED`` and pushes ``OFFSETS_RESET`` (with a generation
   number) to every member;
2. until a member shows it has seen that generation (``reset_gen`` in a pull, commit,
   release or heartbeat), it is **fenced** on those queues: its pulls are answered
   ``LOCKED``, its commits ``NOT_HOLDER``, its releases commit nothing and its heartbeat's
   ``held`` list does not re-take them; a heartbeat answer repeats the pending reset
   (``reset``) for a member that missed the push while disconnected;
3. a member that gets the notice drops those process queues without committing (results of
   listeners still running are thrown away) and takes them again from the broker's offset.

The fences survive a broker restart: they are part of the queue-ownership state
(``ownership.py``), saved whenever it changes and restored at start. Otherwise a member
that had not seen a reset when the broker went down would come back, re-take its queues
at its old positions and commit them, undoing the reset.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import OffsetsReset, ResetReply

if TYPE_CHECKING:
    from ..storage.store import MessageStore
    from .groups import GroupRegistry
    from .ownership_service import OwnershipService

log = logging.getLogger("onceq.broker")

_Queue = tuple[str, int]


@dataclass(slots=True)
class _Fence:
    gen: int
    since: float  # when the last reset fenced the member (broker clock)
    queues: set[_Queue] = field(default_factory=set)


def _generation(value: object) -> bool:
    """A saved generation: what a reply can carry (a non-negative signed 64-bit integer)."""
    return type(value) is int and 0 <= value < 1 << 63


class ResetFence:
    """Per (group, member): the last forced reset it has not acknowledged yet (pure: time
    is passed in; ``changes`` grows with every change of what ``encode`` returns)."""

    def __init__(self) -> None:
        self.last_gen = 0
        self._fences: dict[tuple[str, str], _Fence] = {}
        self.changes = 0

    def _changed(self) -> None:
        self.changes += 1

    def __len__(self) -> int:
        return len(self._fences)

    def to_doc(self) -> dict[str, Any]:
        """The fences as saved (the ``fences`` part of ``ownership.json``)."""
        return {"version": 1, "last_gen": self.last_gen, "fences": [
            [g, c, f.gen, f.since, sorted([t, q] for t, q in f.queues)]
            for (g, c), f in sorted(self._fences.items())]}

    def encode(self) -> bytes:
        return json.dumps(self.to_doc(), separators=(",", ":")).encode()

    def restore(self, data: bytes) -> int:
        """Load saved fences (replacing these); return how many. Raises ValueError, naming
        what is wrong, for data that is not a fence document."""
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not JSON: {exc}") from None
        return self.load_doc(doc)

    def load_doc(self, doc: object) -> int:
        """:meth:`restore` of a parsed document."""
        if (not isinstance(doc, dict) or doc.get("version") != 1
                or not _generation(doc.get("last_gen"))
                or not isinstance(doc.get("fences"), list)):
            raise ValueError("not a version 1 reset-fence document")
        fences: dict[tuple[str, str], _Fence] = {}
        for row in doc["fences"]:
            ok = (isinstance(row, list) and len(row) == 5 and isinstance(row[0], str)
                  and isinstance(row[1], str) and _generation(row[2])
                  and isinstance(row[3], int | float) and isinstance(row[4], list)
                  and all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], str)
                          and type(x[1]) is int for x in row[4]))
            if not ok:
                raise ValueError(f"bad fence row {str(row)[:80]}")
            fences[(row[0], row[1])] = _Fence(row[2], float(row[3]),
                                              {(t, q) for t, q in row[4]})
        self.last_gen, self._fences = doc["last_gen"], fences
        return len(fences)

    def add(self, group: str, clients: list[str], queues: set[_Queue], now: float) -> int:
        """Fence ``clients`` on ``queues``; return the reset's generation. Generations grow
        across broker restarts too (they start from the clock in ms), so a member's
        generation from before a restart never acknowledges a later reset."""
        self.last_gen = gen = max(self.last_gen + 1, int(now * 1000))
        for c in clients:
            f = self._fences.setdefault((group, c), _Fence(gen, now))
            f.gen, f.since = gen, now
            f.queues |= queues
        if clients:
            self._changed()
        return gen

    def expire(self, now: float, max_age: float, is_member: Callable[[str, str], bool]
               ) -> None:
        """Forget fences of clients that are not members and were fenced ``max_age`` ago
        (taken as gone for good: bounds the table)."""
        for key, f in list(self._fences.items()):
            if now - f.since > max_age and not is_member(*key):
                del self._fences[key]
                self._changed()

    def seen(self, group: str, client: str | None, gen: object) -> None:
        """The member reports it has handled resets up to ``gen``."""
        if client is None or type(gen) is not int:
            return
        f = self._fences.get((group, client))
        if f is not None and gen >= f.gen:
            del self._fences[(group, client)]
            self._changed()

    def blocks(self, group: str | None, client: str | None, topic: str, queue: int) -> bool:
        if group is None or client is None:
            return False
        f = self._fences.get((group, client))
        return f is not None and (topic, queue) in f.queues

    def pending(self, group: str, client: str) -> dict | None:
        """The notice a fenced member still has to handle (for a heartbeat answer)."""
        f = self._fences.get((group, client))
        if f is None:
            return None
        return {"group": group, "gen": f.gen, "queues": sorted([t, q] for t, q in f.queues)}

    def drop_client(self, group: str, client: str) -> None:
        """The member left for good (unregistered): nothing to fence any more."""
        if self._fences.pop((group, client), None) is not None:
            self._changed()

    def drop_topic(self, topic: str) -> None:
        for key, f in list(self._fences.items()):
            kept = {k for k in f.queues if k[0] != topic}
            if kept != f.queues:
                f.queues = kept
                if not kept:
                    del self._fences[key]
                self._changed()


def clamp(offset: int, lo: int, hi: int) -> int:
    return max(lo, min(offset, hi))


def parse_targets(raw: object, queues: int) -> dict[int, int]:
    """The ``offsets`` field of a reset: ``[[queue, offset], ...]``, one per queue."""
    if not isinstance(raw, list) or not raw:
        raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                         "offsets must be a non-empty list of [queue, offset]")
    out: dict[int, int] = {}
    for item in raw:
        if (not isinstance(item, list) or len(item) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in item)):
            raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                             "offsets must be a non-empty list of [queue, offset]")
        q, off = item
        if not 0 <= q < queues:
            raise OnceqError(ErrorCode.INVALID_QUEUE, f"queue {q} out of range ({queues} queues)")
        if q in out:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, f"queue {q} listed twice")
        out[q] = off
    return out


def reset_offsets(store: MessageStore, groups: GroupRegistry, owners: OwnershipService,
                  wake: Callable[[str, int], None], *, group: str, topic: str,
                  targets: dict[int, int], force: bool, restored: list[str]
                  ) -> tuple[ResetReply, int]:
    """Apply a reset; returns the answer and the log position it is durable at.
    ``wake(topic, queue)`` answers the pulls held on a reset queue (``LOCKED``);
    ``restored`` are the members known from locks restored at start, not back yet."""
    members = [m.client_id for m in groups.members(group)]
    members += [c for c in restored if c not in members]
    if members and not force:
        raise OnceqError(ErrorCode.GROUP_ACTIVE, (
            f"group {group!r} has {len(members)} live member(s) ({', '.join(members[:5])}"
            f"{', ...' if len(members) > 5 else ''}): stop them first, or force the reset"))
    rows = []
    for q, wanted in sorted(targets.items()):
        lo, hi = store.min_max(topic, q)
        rows.append([q, store.get_offset(group, topic, q), clamp(wanted, lo, hi)])
    gen = 0
    if members:  # forced: the members must not overwrite it, and must read from it
        keys = {(topic, q) for q, _old, _new in rows}
        gen = owners.reset(group, members, keys)
        notice = OffsetsReset(group, gen, sorted([t, q] for t, q in keys))
        for m in groups.members(group):
            m.conn.push(notice)
        for q, _old, _new in rows:
            wake(topic, q)  # held pulls of its members: LOCKED
    end = 0
    for q, old, new in rows:
        end = max(end, store.commit_offset(group, topic, q, new))
        log.info("offsets of group %s on %s queue %d reset from %d to %d%s", group, topic, q,
                 old, new, " (forced)" if members else "")
    return ResetReply(group, topic, rows, members, gen), end
