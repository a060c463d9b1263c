"""Transition-state queue access lock (after DeFiBus), broker side.

During a rebalance two members of a CLUSTERING group can briefly both believe they own a
queue: the new owner starts pulling while the old owner is still consuming (and has not yet
committed) what it pulled. Both then see the same messages, which is a main source of
duplicate deliveries. The access lock lets the broker serialise that hand-over: per
(group, topic, queue) it remembers which client last pulled (the *holder*), and a pull by any
other client is refused ("queue is locked by another client": no messages, same next offset;
the client simply retries) until one of these holds:

* **drained**: everything delivered has been acked (``deliver_offset == ack_offset``) and the
  deliver offset has not moved for ``stable_checks`` (default 3) consecutive checks, a check
  being a pull by a non-holder; or
* **timeout**: the holder has not been seen for ``hold_timeout`` seconds (default 30).

A client that takes a queue over has its requested offset corrected forward to the ack
offset (never backwards, never to the invalid ``-1``) so that it does not re-read what the
previous holder already consumed.

Timeouts, and why they differ from DeFiBus
------------------------------------------
In DeFiBus the hold timeout is tiny (100 ms) and the holder's access time is refreshed only by
fresh pulls. A holder whose pull is *suspended* in long polling (up to 15 s on an idle queue)
therefore looks idle and is displaced while alive, which defeats the lock exactly when it
matters. Here the broker keeps a live holder's lock fresh through three paths:

* every pull by the holder (:meth:`AccessLockTable.on_pull`);
* :meth:`AccessLockTable.touch` while the holder's pull is suspended in long polling, and while
  it drains or commits after a revoke;
* :meth:`AccessLockTable.touch_client` on every client heartbeat (clients send one every few
  seconds).

So ``hold_timeout`` is tied to heartbeat behaviour rather than to pull behaviour: the default
of 30 s spans several missed heartbeats, so a live, connected holder is never displaced by the
timeout. A crashed holder does not wait for it either: the broker calls
:meth:`AccessLockTable.release_client` as soon as the client unregisters, its connection
closes, or its heartbeat expires, and the next pull takes the queue as ``"free"``. The timeout
only matters for a client that is hung but still connected.

Broker restarts
---------------
The table lives in memory, so the broker writes its holders (and deliver offsets) to a
small file whenever a holder changes (:meth:`AccessLockTable.export`) and reads them back
at start (:meth:`AccessLockTable.restore`). A restored holder is *unconfirmed*: it may be
alive and still consuming what it pulled before the restart, but the broker cannot tell yet.
Until it is confirmed, no other client takes the queue, not even by the drained rule (the
ack offsets it relies on may predate the restart). It is confirmed when the holder
re-asserts the queue on its first heartbeat after reconnecting (:meth:`AccessLockTable.reassert`)
or pulls it; it is removed when that heartbeat does not list the queue (the client no longer
holds it); and it lapses when ``restore_hold`` seconds (counted from the restore, that is
from broker start) pass without either, for a holder that died while the broker was down.
Within that same time a member may also take back a free queue it lists in its heartbeat,
if nobody held it since the start: its lock was taken after the last save, or the file was
damaged. Outside that protocol a heartbeat never takes a queue: a member whose lock expired
or was handed over while it was away (a long pause) learns from the answer that it holds
the queue no more, and its next pull takes the queue afresh at the group's offset.

The lock reduces duplicates caused by rebalances; it cannot remove them all (for instance a
message retried after a consume failure), so consumers still need idempotency.

The class is pure and I/O-free: time is passed in as ``now`` (seconds, any monotonic origin) on
every call and no clock is read. It is not thread-safe; the broker calls it from one event
loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..storage.metadata import versioned_doc

__all__ = ["AccessLockTable", "LockDecision", "LockRow", "decode_lock_rows",
           "encode_lock_rows", "lock_rows"]

TAKEOVER_FREE = "free"
TAKEOVER_DRAINED = "drained"
TAKEOVER_TIMEOUT = "timeout"
TAKEOVER_UNCONFIRMED = "unconfirmed-timeout"

_Key = tuple[str, str, int]


@dataclass(frozen=True)
class LockDecision:
    """Outcome of :meth:`AccessLockTable.on_pull`."""

    granted: bool
    """False: the pull is refused, "queue is locked by another client"."""
    offset: int
    """The offset the pull must read from (corrected forward on takeover)."""
    takeover: str | None
    """None, "free", "drained" or "timeout": why the caller became the holder."""
    previous_holder: str | None
    """Holder before this call (None if the queue was free)."""
    holder: str
    """Holder after this call."""


@dataclass
class _Entry:
    holder: str
    last_access: float
    last_deliver_offset: int
    unchanged_checks: int = 0
    pending_handover: bool = False
    unconfirmed_until: float | None = None
    """Restored at start and not re-asserted yet: nobody else takes it before this time."""
    correct_next_pull: bool = False
    """Taken by a heartbeat, not a pull: the holder's first pull is corrected forward."""


@dataclass(frozen=True, slots=True)
class LockRow:
    """One holder as it is saved across a restart."""

    group: str
    topic: str
    queue_id: int
    holder: str
    deliver_offset: int


def _forward_offset(requested_offset: int, ack_offset: int) -> int:
    """Offset corrected forward to the ack offset: never backwards, never to -1."""
    if ack_offset >= 0:
        return max(requested_offset, ack_offset)
    return requested_offset


class AccessLockTable:
    """Per (group, topic, queue) access lock held by one client at a time."""

    def __init__(self, hold_timeout: float = 30.0, stable_checks: int = 3,
                 restore_hold: float = 20.0) -> None:
        if not hold_timeout > 0:
            raise ValueError(f"hold_timeout must be > 0, got {hold_timeout!r}")
        if not restore_hold > 0:
            raise ValueError(f"restore_hold must be > 0, got {restore_hold!r}")
        if stable_checks < 0:
            raise ValueError(f"stable_checks must be >= 0, got {stable_checks!r}")
        self.hold_timeout = float(hold_timeout)
        self.stable_checks = int(stable_checks)
        self.restore_hold = float(restore_hold)
        self.changes = 0
        """Counts changes of holders: the broker saves the table when it moves."""
        self._entries: dict[_Key, _Entry] = {}
        self._by_client: dict[str, set[_Key]] = {}
        self._restart_until: float | None = None
        """End of the restart protocol (set by :meth:`restore`; None: over)."""
        self._touched: set[_Key] = set()
        """Queues held or released since the restart, while the protocol runs."""

    # -- pulls ---------------------------------------------------------------------------

    def on_pull(
        self,
        group: str,
        topic: str,
        queue_id: int,
        client_id: str,
        requested_offset: int,
        ack_offset: int,
        deliver_offset: int,
        now: float,
    ) -> LockDecision:
        """Decide whether ``client_id`` may pull the queue, and from which offset.

        ``ack_offset`` is the group's committed offset for the queue (-1 if none) and
        ``deliver_offset`` the broker's current deliver offset for it.
        """
        key = (group, topic, queue_id)
        entry = self._entries.get(key)

        if entry is None:
            self._set_holder(key, None, client_id, deliver_offset, now)
            return LockDecision(
                granted=True,
                offset=_forward_offset(requested_offset, ack_offset),
                takeover=TAKEOVER_FREE,
                previous_holder=None,
                holder=client_id,
            )

        if entry.holder == client_id:
            entry.last_access = max(entry.last_access, now)
            entry.unconfirmed_until = None  # a restored holder that pulls is alive
            if deliver_offset != entry.last_deliver_offset:
                entry.last_deliver_offset = deliver_offset
                entry.unchanged_checks = 0
            offset = requested_offset
            if entry.correct_next_pull:  # its start offset may predate the last commit
                entry.correct_next_pull = False
                offset = _forward_offset(requested_offset, ack_offset)
            return LockDecision(
                granted=True,
                offset=offset,
                takeover=None,
                previous_holder=client_id,
                holder=client_id,
            )

        # Another client holds the queue: this pull is a check.
        if deliver_offset == entry.last_deliver_offset:
            entry.unchanged_checks += 1
        else:
            entry.last_deliver_offset = deliver_offset
            entry.unchanged_checks = 0

        previous = entry.holder
        takeover: str | None = None
        if entry.unconfirmed_until is not None:
            # restored at start: the holder may still be consuming what it pulled before
            if now >= entry.unconfirmed_until:
                takeover = TAKEOVER_UNCONFIRMED
        elif deliver_offset == ack_offset and entry.unchanged_checks >= self.stable_checks:
            takeover = TAKEOVER_DRAINED
        elif now - entry.last_access >= self.hold_timeout:
            takeover = TAKEOVER_TIMEOUT

        if takeover is None:
            entry.pending_handover = True
            return LockDecision(
                granted=False,
                offset=requested_offset,
                takeover=None,
                previous_holder=previous,
                holder=previous,
            )

        self._set_holder(key, previous, client_id, deliver_offset, now)
        return LockDecision(
            granted=True,
            offset=_forward_offset(requested_offset, ack_offset),
            takeover=takeover,
            previous_holder=previous,
            holder=client_id,
        )

    # -- liveness ------------------------------------------------------------------------

    def touch(self, *, group: str, topic: str, queue_id: int, client_id: str, now: float
              ) -> None:
        """The holder is alive (pull suspended in long polling, draining, committing).

        Refreshes the access time only if ``client_id`` is the holder; otherwise does nothing.
        """
        entry = self._entries.get((group, topic, queue_id))
        if entry is not None and entry.holder == client_id:
            entry.last_access = max(entry.last_access, now)

    def touch_client(self, client_id: str, now: float) -> None:
        """Refresh every lock held by ``client_id`` (called on its heartbeat)."""
        for key in self._by_client.get(client_id, ()):
            entry = self._entries[key]
            entry.last_access = max(entry.last_access, now)

    def reassert(self, group: str, client_id: str, held: dict[tuple[str, int], int],
                 now: float) -> dict[tuple[str, int], bool]:
        """A client lists the queues of ``group`` it holds (on every heartbeat).

        ``held`` maps (topic, queue_id) to the client's next offset to pull there (its
        deliver offset). Per listed queue: the client's own lock is confirmed and refreshed;
        a queue held by another client is left alone. A free queue is taken only as the
        restart protocol allows (:meth:`restart_claimable`): a lock that expired, was
        released or was handed over while the client was away is not its own any more,
        and its next pull takes the queue again at the group's offset. A restored,
        unconfirmed lock of this client on a queue it does not list is released: the
        client no longer holds it. Returns, per listed queue, whether the client holds it
        now (False: stop consuming it).
        """
        result: dict[tuple[str, int], bool] = {}
        for (topic, queue_id), deliver in held.items():
            key = (group, topic, queue_id)
            entry = self._entries.get(key)
            if entry is None:
                if not self.restart_claimable(key, now):
                    result[(topic, queue_id)] = False
                    continue
                # its holder before the restart (whose lock the broker lost): its next pull
                # is still corrected forward to the ack offset
                self._set_holder(key, None, client_id, deliver, now)
                self._entries[key].correct_next_pull = True
                result[(topic, queue_id)] = True
            elif entry.holder == client_id:
                entry.last_access = max(entry.last_access, now)
                entry.unconfirmed_until = None
                if deliver > entry.last_deliver_offset:
                    entry.last_deliver_offset = deliver
                    entry.unchanged_checks = 0
                result[(topic, queue_id)] = True
            else:
                result[(topic, queue_id)] = False
        for key in sorted(self._by_client.get(client_id, ())):
            if (key[0] == group and (key[1], key[2]) not in held
                    and self._entries[key].unconfirmed_until is not None):
                self.release(group=key[0], topic=key[1], queue_id=key[2],
                             client_id=client_id)
        return result

    def restart_claimable(self, key: _Key, now: float) -> bool:
        """Whether a heartbeat may take the free queue ``key``: only within ``restore_hold``
        of the broker's start (:meth:`restore`) and only if nobody held or released it
        since, that is when the broker may have lost its holder in the restart (a lock
        taken after the last save, or a damaged lock file)."""
        if self._restart_until is None:
            return False
        if now >= self._restart_until:
            self._restart_until = None  # the restart protocol is over
            self._touched.clear()
            return False
        return key not in self._touched

    # -- release -------------------------------------------------------------------------

    def release(self, *, group: str, topic: str, queue_id: int, client_id: str) -> bool:
        """Release the queue if ``client_id`` holds it; return whether it did."""
        key = (group, topic, queue_id)
        entry = self._entries.get(key)
        if entry is None or entry.holder != client_id:
            return False
        del self._entries[key]
        self._unindex(client_id, key)
        self._touch_key(key)
        self.changes += 1
        return True

    def release_client(self, client_id: str) -> list[tuple[str, str, int]]:
        """Remove every lock of ``client_id`` (unregister, disconnect, heartbeat expiry).

        Returns the removed (group, topic, queue_id) keys, sorted.
        """
        keys = self._by_client.pop(client_id, set())
        for key in keys:
            del self._entries[key]
            self._touch_key(key)
        if keys:
            self.changes += 1
        return sorted(keys)

    def release_client_group(self, client_id: str, group: str) -> list[tuple[str, str, int]]:
        """Remove the locks ``client_id`` holds in ``group`` only (it left that group)."""
        keys = sorted(k for k in self._by_client.get(client_id, ()) if k[0] == group)
        for key in keys:
            del self._entries[key]
            self._unindex(client_id, key)
            self._touch_key(key)
        if keys:
            self.changes += 1
        return keys

    def drop_topic(self, topic: str) -> None:
        """Remove every lock on ``topic`` (it was deleted)."""
        for key in [k for k in self._entries if k[1] == topic]:
            entry = self._entries.pop(key)
            self._unindex(entry.holder, key)
            self._touch_key(key)
            self.changes += 1

    def unconfirmed_holders(self, group: str, now: float) -> list[str]:
        """Restored holders of ``group`` that have not re-asserted yet and whose restore hold
        still runs: members that may be alive but have not reconnected."""
        return sorted({e.holder for (g, _t, _q), e in self._entries.items()
                       if g == group and e.unconfirmed_until is not None
                       and now < e.unconfirmed_until})

    # -- inspection ----------------------------------------------------------------------

    def holder(self, group: str, topic: str, queue_id: int) -> str | None:
        entry = self._entries.get((group, topic, queue_id))
        return None if entry is None else entry.holder

    def snapshot(self, group: str) -> list[dict]:
        """Lock state of every locked queue of ``group``, sorted by (topic, queue_id)."""
        rows = []
        for (g, topic, queue_id), entry in sorted(self._entries.items()):
            if g != group:
                continue
            rows.append(
                {
                    "topic": topic,
                    "queue_id": queue_id,
                    "holder": entry.holder,
                    "last_access": entry.last_access,
                    "last_deliver_offset": entry.last_deliver_offset,
                    "unchanged_checks": entry.unchanged_checks,
                    "pending_handover": entry.pending_handover,
                    "unconfirmed": entry.unconfirmed_until is not None,
                }
            )
        return rows

    # -- persistence ---------------------------------------------------------------------

    def export(self) -> list[LockRow]:
        """Every holder with its deliver offset, sorted: what survives a restart."""
        return [LockRow(g, t, q, e.holder, e.last_deliver_offset)
                for (g, t, q), e in sorted(self._entries.items())]

    def restore(self, rows: list[LockRow], now: float) -> None:
        """Load saved holders at start (replacing the table), each unconfirmed until
        ``now + restore_hold``; ``now`` is the broker's start time. Starts the restart
        protocol: for ``restore_hold`` a holder the broker lost (no saved row) may take its
        queue back by listing it in a heartbeat (:meth:`reassert`)."""
        self._entries.clear()
        self._by_client.clear()
        self._restart_until = now + self.restore_hold
        self._touched.clear()
        for r in rows:
            key = (r.group, r.topic, r.queue_id)
            old = self._entries.get(key)
            if old is not None:
                self._unindex(old.holder, key)
            self._entries[key] = _Entry(holder=r.holder, last_access=now,
                                        last_deliver_offset=r.deliver_offset,
                                        unconfirmed_until=now + self.restore_hold)
            self._by_client.setdefault(r.holder, set()).add(key)

    def __len__(self) -> int:
        return len(self._entries)

    # -- internals -----------------------------------------------------------------------

    def _set_holder(
        self,
        key: _Key,
        previous: str | None,
        client_id: str,
        deliver_offset: int,
        now: float,
    ) -> None:
        if previous is not None:
            self._unindex(previous, key)
        self._touch_key(key)
        self.changes += 1
        self._entries[key] = _Entry(
            holder=client_id, last_access=now, last_deliver_offset=deliver_offset
        )
        self._by_client.setdefault(client_id, set()).add(key)

    def _touch_key(self, key: _Key) -> None:
        if self._restart_until is not None:
            self._touched.add(key)

    def _unindex(self, client_id: str, key: _Key) -> None:
        keys = self._by_client.get(client_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_client[client_id]


# -- file format (pure) --------------------------------------------------------------------

LOCK_FILE_VERSION = 1


def encode_lock_rows(rows: list[LockRow]) -> bytes:
    """The saved holders as JSON: ``{"version": 1, "locks": [[group, topic, queue, holder,
    deliver offset], ...]}``."""
    locks = [[r.group, r.topic, r.queue_id, r.holder, r.deliver_offset] for r in rows]
    return json.dumps({"version": LOCK_FILE_VERSION, "locks": locks},
                      separators=(",", ":")).encode()


def decode_lock_rows(raw: bytes) -> list[LockRow]:
    """Parse :func:`encode_lock_rows` output; ValueError when it is damaged."""
    return lock_rows(versioned_doc(raw, LOCK_FILE_VERSION, "access lock file").get("locks"))


def lock_rows(locks: object) -> list[LockRow]:
    """The rows of a parsed list of ``[group, topic, queue, holder, deliver offset]``;
    ValueError for a damaged one."""
    if not isinstance(locks, list):
        raise ValueError("access locks must be a list")
    rows = []
    for item in locks:
        if not (isinstance(item, list) and len(item) == 5
                and isinstance(item[0], str) and isinstance(item[1], str)
                and type(item[2]) is int and item[2] >= 0 and isinstance(item[3], str)
                and type(item[4]) is int):
            raise ValueError(f"access lock file has a bad row: {item!r}")
        rows.append(LockRow(item[0], item[1], item[2], item[3], item[4]))
    return rows
