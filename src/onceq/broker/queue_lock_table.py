"""Orderly queue locks, broker side: a pure table (time passed in, no I/O).

An orderly consumer consumes a queue only while it holds the queue's lock in its group
(``group -> (topic, queue) -> holder, last renewal``). It locks a batch of queues at once
(:meth:`QueueLockTable.lock`: the answer is the set of those it holds now), renews them
with the same call every 20 s, and unlocks them on revoke, after committing their offsets
(:meth:`QueueLockTable.unlock` runs the commit first, then releases: the next holder reads
the offset the previous one reached; RocketMQ released first, issue #4086). A lock not
renewed for ``expiry`` seconds (60) is free for anyone. Only the holder can unlock or
commit. When a client unregisters, its connection closes or its heartbeat expires, its
locks go at once (:meth:`QueueLockTable.release_client`), so a new owner does not wait for
the expiry.

The broker saves the holders whenever they change (:meth:`QueueLockTable.export`,
:func:`encode_lock_file`) and restores them at start (:meth:`QueueLockTable.restore`). A
restored lock counts as renewed at the restore: its holder, still consuming what it pulled
before the broker went down, keeps the queue when it locks again after reconnecting, and a
holder that died meanwhile frees it after ``expiry`` seconds. Without this, the first member
back could lock a queue that its old holder, not yet reconnected, still consumes for up to
the 30 s its client trusts a lock. Until their holder locks again, restored locks count
their holders as members (:meth:`QueueLockTable.restored_holders`), so the members that
reconnect first keep their allocation.

This is the second kind of lock on a queue of a group; the first is the transition-state
access lock (``access_lock.py``), which concurrent members take implicitly by pulling.
A queue has at most one holder of either kind at a time: :meth:`lock` is given the access
lock's holders (``taken``) and does not grant a queue another client holds there, and the
broker refuses a pull of a queue whose orderly lock another client holds (see
``ownership.py`` and ``docs/consumer.md``, "Orderly consumption").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..storage.metadata import versioned_doc

__all__ = ["QueueLockTable", "decode_lock_file", "encode_lock_file", "lock_rows"]

_Queue = tuple[str, int]
_Row = tuple[str, str, int, str]  # group, topic, queue, holder
_VERSION = 1


def encode_lock_file(rows: Iterable[_Row]) -> bytes:
    """The saved form of the locks (``queue_locks.json`` of earlier versions; the state is
    saved in ``ownership.json`` now, see ``ownership.py``)."""
    return json.dumps({"version": _VERSION, "locks": [list(r) for r in rows]},
                      separators=(",", ":")).encode()


def decode_lock_file(data: bytes) -> list[_Row]:
    """The rows of a saved lock file; raises ValueError naming what is wrong."""
    return lock_rows(versioned_doc(data, _VERSION, "queue-lock file").get("locks"))


def lock_rows(rows: object) -> list[_Row]:
    """The rows of a parsed list of ``[group, topic, queue, holder]``; ValueError for a
    damaged one."""
    if not isinstance(rows, list):
        raise ValueError("queue locks must be a list")
    out = []
    for r in rows:
        if not (isinstance(r, list) and len(r) == 4 and isinstance(r[0], str)
                and isinstance(r[1], str) and type(r[2]) is int and r[2] >= 0
                and isinstance(r[3], str)):
            raise ValueError(f"bad lock row {str(r)[:80]}")
        out.append((r[0], r[1], r[2], r[3]))
    return out


@dataclass(slots=True)
class _Lock:
    holder: str
    since: float  # granted (a renewal keeps it)
    renewed: float  # last lock or renewal
    restored: bool = False  # restored at broker start, not locked again by its holder yet


class QueueLockTable:
    def __init__(self, expiry: float = 60.0) -> None:
        self.expiry = expiry
        self._locks: dict[str, dict[_Queue, _Lock]] = {}  # group -> queue -> lock
        self.changes = 0  # counts changes of holders (what the saved file holds)

    def _live(self, group: str, queue: _Queue, now: float) -> _Lock | None:
        lock = self._locks.get(group, {}).get(queue)
        if lock is None or now - lock.renewed > self.expiry:
            return None
        return lock

    def holder(self, group: str, topic: str, queue_id: int, now: float) -> str | None:
        """Who holds the queue's lock now (an expired lock is held by nobody)."""
        lock = self._live(group, (topic, queue_id), now)
        return None if lock is None else lock.holder

    def lock(self, group: str, client: str, queues: Iterable[_Queue], now: float,
             taken: Callable[[str, int], str | None] | None = None) -> set[_Queue]:
        """Lock or renew ``queues`` for ``client``; return those it holds now. A queue is
        granted when it is free (never locked, unlocked or expired) or already the
        client's, and ``taken`` (the other lock kind's holder) names nobody else."""
        held = set()
        table = self._locks.setdefault(group, {})
        for q in queues:
            lock = self._live(group, q, now)
            if lock is not None and lock.holder != client:
                continue
            other = taken(*q) if taken is not None else None
            if other is not None and other != client:
                continue
            if lock is None:
                table[q] = _Lock(client, now, now)
                self.changes += 1
            else:
                lock.renewed = now
                lock.restored = False
            held.add(q)
        return held

    def unlock(self, group: str, client: str, queues: Iterable[_Queue], now: float,
               commit: Callable[[_Queue], None] | None = None) -> set[_Queue]:
        """Release the queues ``client`` holds among ``queues``; for each, ``commit`` runs
        first (while the lock is still held). Queues it does not hold are left alone and
        not committed. Return the queues released."""
        released = set()
        table = self._locks.get(group, {})
        for q in queues:
            lock = self._live(group, q, now)
            if lock is None or lock.holder != client:
                continue
            if commit is not None:
                commit(q)  # an error here leaves the lock held: the client retries
            del table[q]
            self.changes += 1
            released.add(q)
        return released

    def release_client(self, client: str, group: str | None = None) -> list[tuple[str, str, int]]:
        """Drop every lock of ``client`` (in ``group`` only, when given)."""
        gone = []
        for g, table in self._locks.items():
            if group is not None and g != group:
                continue
            for q in [q for q, lock in table.items() if lock.holder == client]:
                del table[q]
                gone.append((g, *q))
        self.changes += len(gone)
        return gone

    def expire(self, now: float) -> list[tuple[str, str, int, str]]:
        """Forget the expired locks (they are already free); return them with holders."""
        gone = []
        for g, table in self._locks.items():
            for q in [q for q, lock in table.items() if now - lock.renewed > self.expiry]:
                gone.append((g, *q, table.pop(q).holder))
        self.changes += len(gone)
        return gone

    def drop_topic(self, topic: str) -> None:
        for table in self._locks.values():
            for q in [q for q in table if q[0] == topic]:
                del table[q]
                self.changes += 1

    def export(self, now: float) -> list[_Row]:
        """The live locks, sorted: what survives a broker restart."""
        return sorted((g, t, q, lock.holder) for g, table in self._locks.items()
                      for (t, q), lock in table.items() if now - lock.renewed <= self.expiry)

    def restore(self, rows: Iterable[_Row], now: float) -> None:
        """Load saved locks at broker start (replacing the table), each renewed ``now``."""
        self._locks = {}
        for g, t, q, holder in rows:
            self._locks.setdefault(g, {})[(t, q)] = _Lock(holder, now, now, restored=True)

    def restored_holders(self, group: str, now: float) -> list[str]:
        """Holders of live locks restored at start that have not locked again since."""
        return sorted({lock.holder for lock in self._locks.get(group, {}).values()
                       if lock.restored and now - lock.renewed <= self.expiry})

    def snapshot(self, group: str, now: float) -> list[dict]:
        """The live locks of ``group``: holder, age (since granted), seconds since renewal."""
        return [{"topic": t, "queue": q, "holder": lock.holder,
                 "age_s": round(now - lock.since, 3), "renewed_s": round(now - lock.renewed, 3)}
                for (t, q), lock in sorted(self._locks.get(group, {}).items())
                if now - lock.renewed <= self.expiry]
