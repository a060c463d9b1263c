"""Queue ownership: who may pull and commit each queue of each consumer group (pure core).

One object holds what decides it, in REFERENCE.md's names:

* the transition-state **access lock** (``access_lock.py``), taken implicitly by the pulls
  of concurrent members, and the **deliver offsets** it reads;
* the orderly **queue lock** (``queue_lock_table.py``), taken explicitly by orderly members;
* the **reset fence** (``offset_reset.py``), which holds the members that have not seen a
  forced offset reset yet;
* the **commit rule**, which says whose commits set the group's ack offset, and which way.

Every request that reads or commits a queue runs the same checks, in this order:

1. **fence**: a member that has not seen a forced reset of the queue neither pulls nor
   commits it;
2. **orderly lock**: while another client holds the queue's orderly lock, only that client
   pulls and commits;
3. **access lock**: a member the access lock applies to must hold the queue (a pull may take
   it: free, drained, timed out); any other client commits only while nobody holds it;
4. **range and direction** (commits): an offset past the queue's end is refused, and the
   offset only moves forward. A commit below the stored offset comes from a stale process
   queue (a member that was paused past its lock, a late commit of a queue given up). The
   only ways back are an explicit reset (:meth:`QueueOwnership.reset`, which does not go
   through the rule) and a stored offset past the queue's end after a damaged log was cut
   back: a lower commit then repairs it.

The core does no I/O and reads no clock: facts come in as arguments (the queue's committed
offset and end, whether the access lock applies to the client, the time), decisions come
out as values, and the broker applies them (``ownership_service.py``). The simulation and
the property tests drive this same code.

Persistence: :meth:`QueueOwnership.encode` is one document (the access-lock holders with
their deliver offsets, the orderly locks, the fences), written atomically whenever
:attr:`QueueOwnership.changes` moved; :meth:`QueueOwnership.restore` loads it at start.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

from ..storage.metadata import versioned_doc
from .access_lock import AccessLockTable, LockDecision, LockRow
from .access_lock import lock_rows as access_rows
from .offset_reset import ResetFence
from .queue_lock_table import QueueLockTable
from .queue_lock_table import lock_rows as orderly_rows

__all__ = ["CommitDecision", "PullDecision", "QueueOwnership", "Refusal", "moves_forward"]

_Key = tuple[str, str, int]  # group, topic, queue
_Queue = tuple[str, int]
FILE_VERSION = 1
FENCE_MAX_AGE_S = 3600.0  # a fence of a client that is no member is kept this long


class Refusal(Enum):
    FENCED = "fenced"
    """The client has not seen a forced reset of the queue yet."""
    NOT_HOLDER = "not-holder"
    """Another client holds the queue (orderly or access lock)."""
    BEHIND = "behind"
    """The commit is below the stored offset."""
    PAST_END = "past-end"
    """The commit is past the queue's end (nothing was read there)."""


@dataclass(frozen=True, slots=True)
class PullDecision:
    refused: Refusal | None
    """None: serve the pull (FENCED or NOT_HOLDER: answer ``LOCKED``)."""
    offset: int
    """Where to read: the requested offset, corrected forward on a takeover."""
    lock: LockDecision | None = None
    """The access lock's decision (None: the lock does not apply to the client)."""
    corrected: bool = False
    """The read was moved forward to the group's offset (a takeover): a commit the pull
    carries is the client's stale start, not progress."""


@dataclass(frozen=True, slots=True)
class CommitDecision:
    refused: Refusal | None
    """None: store :attr:`write` (or nothing changes)."""
    stored: int
    """The group's offset after the commit (-1: none)."""
    write: int | None = None
    """The offset to store (None: nothing to store)."""


def moves_forward(stored: int, offset: int, queue_max: int) -> bool:
    """Whether a commit of ``offset`` may replace ``stored`` (-1: none) on a queue whose next
    offset to write is ``queue_max``: never backwards, unless ``stored`` lies past the
    queue's end."""
    return offset >= stored or stored > queue_max


class QueueOwnership:
    """The ownership state of every queue of every group, and the rules over it."""

    def __init__(self, *, hold_timeout: float = 30.0, stable_checks: int = 3,
                 restore_hold: float = 20.0, lock_expiry: float = 60.0) -> None:
        self.access = AccessLockTable(hold_timeout, stable_checks, restore_hold)
        self.orderly = QueueLockTable(lock_expiry)
        self.fences = ResetFence()
        self.deliver: dict[_Key, int] = {}
        """Next offset after the last pull that found messages (never below the ack
        offset when read through :meth:`deliver_offset`)."""

    @property
    def changes(self) -> int:
        """Grows whenever what :meth:`encode` holds changed (holders, locks, fences)."""
        return self.access.changes + self.orderly.changes + self.fences.changes

    def deliver_offset(self, key: _Key, ack: int) -> int:
        return max(self.deliver.get(key, ack), ack)

    # -- the checks, in one order ----------------------------------------------------------

    def _orderly_other(self, group: str, client: str | None, topic: str, queue: int,
                       now: float) -> bool:
        holder = self.orderly.holder(group, topic, queue, now)
        return holder is not None and holder != client

    def refusal(self, group: str, client: str | None, topic: str, queue: int, *,
                locked: bool, now: float) -> Refusal | None:
        """Checks 1-3 for a commit (nothing is taken): whether ``client`` (None: it sent
        no id) is refused. ``locked``: the access lock applies to the client."""
        if self.fences.blocks(group, client, topic, queue):
            return Refusal.FENCED
        if self._orderly_other(group, client, topic, queue, now):
            return Refusal.NOT_HOLDER
        holder = self.access.holder(group, topic, queue)
        if client is not None and locked:
            return None if holder == client else Refusal.NOT_HOLDER
        return None if holder is None or holder == client else Refusal.NOT_HOLDER

    # -- events ------------------------------------------------------------------------------

    def pull(self, group: str, client: str | None, topic: str, queue: int, offset: int, *,
             locked: bool, ack: int, now: float) -> PullDecision:
        """A pull of ``group``'s queue by ``client`` from ``offset``; ``ack`` is the group's
        committed offset (-1: none). A member the access lock applies to may take the queue
        here (free, drained, timed out), its read corrected forward to ``ack``."""
        if client is not None and self.fences.blocks(group, client, topic, queue):
            return PullDecision(Refusal.FENCED, offset)
        if self._orderly_other(group, client, topic, queue, now):
            return PullDecision(Refusal.NOT_HOLDER, offset)
        if client is None or not locked:
            return PullDecision(None, offset)
        key = (group, topic, queue)
        d = self.access.on_pull(group, topic, queue, client, offset, ack,
                                self.deliver_offset(key, ack), now)
        return PullDecision(None if d.granted else Refusal.NOT_HOLDER, d.offset, d,
                            d.offset > offset)

    def delivered(self, group: str, topic: str, queue: int, next_offset: int) -> None:
        """A pull under the access lock found messages up to ``next_offset``."""
        key = (group, topic, queue)
        if next_offset > self.deliver.get(key, -1):
            self.deliver[key] = next_offset

    def commit(self, group: str, client: str | None, topic: str, queue: int, offset: int,
               *, locked: bool, stored: int, queue_max: int, now: float,
               checked: bool = False) -> CommitDecision:
        """A commit of ``offset`` by ``client``; ``stored`` is the group's offset (-1: none),
        ``queue_max`` the queue's next offset to write. ``checked``: checks 1-3 just ran
        (a pull granted under the access lock)."""
        if not checked:
            refused = self.refusal(group, client, topic, queue, locked=locked, now=now)
            if refused is not None:
                return CommitDecision(refused, stored)
        if offset > queue_max:
            return CommitDecision(Refusal.PAST_END, stored)
        if not moves_forward(stored, offset, queue_max):
            return CommitDecision(Refusal.BEHIND, stored)
        return CommitDecision(None, offset, offset)

    def release(self, group: str, client: str, topic: str, queue: int, offset: int | None,
                *, locked: bool, stored: int, queue_max: int, now: float
                ) -> tuple[bool, CommitDecision | None]:
        """End of a drain: commit ``offset`` (None: nothing) if the rule allows, then give the
        access lock up. Returns (released, the commit's decision or None)."""
        refused = self.refusal(group, client, topic, queue, locked=locked, now=now)
        released = self.access.release(group=group, topic=topic, queue_id=queue,
                                       client_id=client)
        if offset is None or refused is not None or not (released or not locked):
            return released, None
        return released, self.commit(group, client, topic, queue, offset, locked=locked,
                                     stored=stored, queue_max=queue_max, now=now,
                                     checked=True)

    def heartbeat(self, group: str, client: str, held: list[tuple[str, int, int]] | None,
                  gen: object, *, locked: bool, now: float
                  ) -> tuple[list[tuple[str, int, bool]], dict | None]:
        """A member's heartbeat in ``group``: ``held`` lists (topic, queue, next offset) of
        the queues it says it holds (only existing queues), ``gen`` the last reset it
        handled. Returns per listed queue whether it holds it now (the access lock's
        re-assert: restart protocol), and the reset notice it still has to handle."""
        self.fences.seen(group, client, gen)
        pending = self.fences.pending(group, client)
        holds: list[tuple[str, int, bool]] = []
        if locked and held is not None:
            # the same order as a pull: a queue fenced for it, or whose orderly lock another
            # client holds, is not re-taken
            held = [x for x in held if not self.fences.blocks(group, client, x[0], x[1])
                    and not self._orderly_other(group, client, x[0], x[1], now)]
            wanted = {(t, q): d for t, q, d in held}
            result = self.access.reassert(group, client, wanted, now)
            for (topic, queue), has in sorted(result.items()):
                if has:
                    self.delivered(group, topic, queue, wanted[(topic, queue)])
                holds.append((topic, queue, has))
        return holds, pending

    def touch(self, group: str, client: str, topic: str, queue: int, now: float) -> None:
        """The holder is alive (its pull is suspended in long polling)."""
        self.access.touch(group=group, topic=topic, queue_id=queue, client_id=client, now=now)

    def touch_client(self, client: str, now: float) -> None:
        """A heartbeat of ``client``: every access lock it holds is fresh."""
        self.access.touch_client(client, now)

    def lock(self, group: str, client: str, queues: Iterable[_Queue], now: float
             ) -> set[_Queue]:
        """Orderly lock (or renewal) of ``queues``; returns those ``client`` holds now. A
        queue whose access lock another client holds is not granted."""
        return self.orderly.lock(group, client, queues, now,
                                 lambda t, q: self.access.holder(group, t, q))

    def unlock(self, group: str, client: str, queues: Iterable[_Queue], now: float,
               commit: Callable[[_Queue], None]) -> set[_Queue]:
        """Orderly unlock: for each queue ``client`` holds, ``commit`` runs first (while it
        still holds it), then the lock goes. Returns the queues released."""
        return self.orderly.unlock(group, client, queues, now, commit)

    def member_gone(self, group: str, client: str
                    ) -> tuple[list[tuple[str, str, int]], list[tuple[str, str, int]]]:
        """``client`` left ``group`` (unregistered, disconnected, expired): its locks go at
        once. Returns the (group, topic, queue) of the access locks and of the orderly
        locks removed."""
        return (self.access.release_client_group(client, group),
                self.orderly.release_client(client, group))

    def unregistered(self, group: str, client: str) -> None:
        """``client`` left ``group`` for good: nothing to fence any more."""
        self.fences.drop_client(group, client)

    def reset(self, group: str, members: list[str], queues: set[_Queue], now: float) -> int:
        """A forced offset reset of ``queues``: ``members`` are fenced until they show they
        saw it, the queues' access locks and deliver offsets go (the next pull takes them
        from the new offset). Returns the reset's generation."""
        gen = self.fences.add(group, members, queues, now)
        for topic, queue in sorted(queues):
            holder = self.access.holder(group, topic, queue)
            if holder is not None:
                self.access.release(group=group, topic=topic, queue_id=queue,
                                    client_id=holder)
            self.deliver.pop((group, topic, queue), None)
        return gen

    def drop_topic(self, topic: str) -> None:
        """Forget everything about a deleted topic (a re-created one starts free)."""
        for key in [k for k in self.deliver if k[1] == topic]:
            del self.deliver[key]
        self.access.drop_topic(topic)
        self.orderly.drop_topic(topic)
        self.fences.drop_topic(topic)

    def expire(self, now: float, is_member: Callable[[str, str], bool]) -> None:
        """Forget orderly locks past their expiry (free already) and fences of clients that
        are gone for good: bounds the tables."""
        self.orderly.expire(now)
        self.fences.expire(now, FENCE_MAX_AGE_S, is_member)

    def restored_members(self, group: str, now: float) -> list[str]:
        """Holders of access or orderly locks restored at start that are not back yet."""
        found = self.access.unconfirmed_holders(group, now)
        return found + [c for c in self.orderly.restored_holders(group, now)
                        if c not in found]

    # -- persistence -----------------------------------------------------------------------

    def encode(self, now: float) -> bytes:
        """Everything that survives a restart, as one JSON document."""
        access = [[r.group, r.topic, r.queue_id, r.holder,
                   max(r.deliver_offset, self.deliver.get((r.group, r.topic, r.queue_id), -1))]
                  for r in self.access.export()]
        return json.dumps({"version": FILE_VERSION, "access": access,
                           "orderly": [list(r) for r in self.orderly.export(now)],
                           "fences": self.fences.to_doc()},
                          separators=(",", ":")).encode()

    def restore(self, data: bytes | None, now: float, exists: Callable[[str, int], bool]
                ) -> tuple[int, int, int]:
        """Load :meth:`encode` output at start (``data`` None: nothing saved) and start the
        restart protocol; queues that no longer exist are left out. Returns how many access
        locks, orderly locks and fenced members were restored. Raises ValueError, naming
        what is wrong, for a damaged document (the state then starts empty)."""
        access: list[LockRow] = []
        orderly: list[tuple[str, str, int, str]] = []
        fences = ResetFence()
        try:
            if data is not None:
                access, orderly, fences = _decode(data)
        finally:  # the restart protocol starts even without saved state
            access = [r for r in access if exists(r.topic, r.queue_id)]
            orderly = [r for r in orderly if exists(r[1], r[2])]
            self.access.restore(access, now)
            self.orderly.restore(orderly, now)
            self.fences = fences
            self.deliver = {(r.group, r.topic, r.queue_id): r.deliver_offset for r in access}
        return len(access), len(orderly), len(fences)


def _decode(data: bytes) -> tuple[list[LockRow], list[tuple[str, str, int, str]], ResetFence]:
    doc = versioned_doc(data, FILE_VERSION, "ownership file")
    fences = ResetFence()
    try:
        fences.load_doc(doc.get("fences"))
    except ValueError as exc:
        raise ValueError(f"fences: {exc}") from None
    return access_rows(doc.get("access")), orderly_rows(doc.get("orderly")), fences
