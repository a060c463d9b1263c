"""Dedup records and the decisions taken on them (pure: no I/O, time passed in).

A *record* exists per (group, topic, dedup key). Its life:

* ``claim`` of an unknown key inserts it as ``CONSUMING`` with a fresh *owner token*,
  attempt 1 and a lease: the claimer runs the handler.
* ``complete`` by the owner turns it ``CONSUMED``, kept for the retention time: a later
  copy of the message is acknowledged without running the handler.
* ``extend`` by the owner pushes the lease forward while a slow handler is alive.

* ``release`` by the owner (the handler failed) marks it ``RELEASED``: the redelivery
  claims it again (attempt + 1) and runs the handler.

A claim that finds the key ``CONSUMING`` under a live lease is ``BUSY``: the copy must be
consumed later, never acknowledged (the first attempt may still fail). A claim that finds
the lease expired *takes the record over* (attempt + 1, new owner): the previous attempt
crashed and nobody knows whether its effect happened; the caller's policy decides what to
do (``TAKEN_OVER``). The same key with another payload hash is a ``CONFLICT``.

Complete, release and extend are compare-and-set on the owner token: once a lease expired
and another owner took the record over, the first owner's late calls change nothing and
return False (it learns that it lost). Stores implement exactly these rules, atomically;
the functions below are their definition and the model their tests compare against.

Owner tokens are unique per claim: a claim retried by its owner (after a lost reply) gets
its own claim back. A record past ``expires_at`` is as good as absent (the purge may not
have run yet).
``expires_at`` is the completion time plus the retention for ``CONSUMED`` records, and the
lease end plus the retention for ``CONSUMING`` ones (a crashed claim stays visible long
enough to be recognised as an ambiguous outcome, not mistaken for a first delivery).

Each record keeps its recent *history* (``history``, the last ``HISTORY_CHARS`` characters
of one line per event: ``<time> <event> <attempt> <owner>``): ``claimed``, ``taken-over``,
``extended``, ``completed``, ``released``, and ``fenced-off`` when a stale owner's late
complete, release or extend is refused (the line names the stale owner and the record's
current attempt). ``events(record)`` reads it.

A claim's *fencing token* (``FencingToken.of(record)``) lets systems outside the store
refuse a stale owner: a takeover yields a strictly larger token than the claim it took
over, so a downstream write guarded by ``WHERE fence < :token`` refuses the late write of an
owner that was paused longer than its lease.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, NamedTuple

__all__ = [
    "HISTORY_CHARS",
    "Claim",
    "ClaimResult",
    "Event",
    "FencingToken",
    "Outcome",
    "Record",
    "Status",
    "Ticket",
    "decide_claim",
    "decide_complete",
    "decide_extend",
    "decide_release",
    "events",
    "history_line",
    "payload_hash",
]

HISTORY_CHARS = 2000  # characters of history kept per record (about 25 events)


class Status(StrEnum):
    CONSUMING = "CONSUMING"
    CONSUMED = "CONSUMED"
    RELEASED = "RELEASED"  # the handler failed and gave its claim back


class Outcome(StrEnum):
    CLAIMED = "CLAIMED"  # the key was free: run the handler
    TAKEN_OVER = "TAKEN_OVER"  # an expired claim was taken over: outcome of the last try unknown
    DUPLICATE = "DUPLICATE"  # already CONSUMED: acknowledge without running
    BUSY = "BUSY"  # CONSUMING under a live lease: consume later, never acknowledge
    CONFLICT = "CONFLICT"  # the key is known with another payload


@dataclass(frozen=True, slots=True)
class Record:
    group: str
    topic: str
    key: str
    status: Status
    owner: str
    attempt: int
    lease_until: float
    payload_hash: str
    created_at: float
    updated_at: float
    expires_at: float
    history: str = ""

    def alive(self, now: float) -> bool:
        """Not past retention (a record that is not alive counts as absent)."""
        return self.expires_at > now

    def leased(self, now: float) -> bool:
        """``CONSUMING`` under a lease that has not expired."""
        return self.status is Status.CONSUMING and self.lease_until > now


ATTEMPT_BITS = 20  # the low bits of a fencing token's integer value hold the attempt


@functools.total_ordering
@dataclass(frozen=True, slots=True)
class FencingToken:
    """A claim's fencing token: a downstream system compares it with the last token it
    accepted for the same dedup key and refuses an older one (Kleppmann's fencing token).

    ``epoch`` is the record's creation time in milliseconds (every claim of one record
    shares it: a takeover or the retry of a released claim keeps it); ``attempt`` is the
    claim's attempt number, which every takeover and every retry of a released claim
    increments. Tokens are ordered by ``(epoch, attempt)`` (then by the other fields, so
    that the order is total and agrees with ``==``): a takeover's token is strictly larger
    than the token of the claim it took over, and a record created again after the old one
    expired (past retention, or purged) starts a larger epoch. ``owner`` names the claim's
    owner (for logs; it plays no part in the order between claims of one key).

    ``value`` (also ``int(token)``) is ``epoch << 20 | attempt``, a non-negative integer
    below 2**63 that keeps the same order, for a ``BIGINT`` column::

        UPDATE accounts SET balance = ?, fence = ? WHERE id = ? AND fence < ?

    Compare only tokens of the same (group, topic, dedup key): claims of different keys
    are not ordered with respect to each other.
    """

    group: str
    topic: str
    key: str
    epoch: int
    attempt: int
    owner: str

    def __post_init__(self) -> None:
        if not 0 <= self.attempt < 1 << ATTEMPT_BITS or not 0 <= self.epoch < 1 << (
                63 - ATTEMPT_BITS):
            raise ValueError(f"fencing token out of range: epoch {self.epoch}, attempt "
                             f"{self.attempt}")

    @classmethod
    def of(cls, rec: Record) -> FencingToken:
        """The token of the claim that ``rec`` records (its current owner's)."""
        return cls(rec.group, rec.topic, rec.key, int(rec.created_at * 1000), rec.attempt,
                   rec.owner)

    @property
    def value(self) -> int:
        """The token as one integer, ordered like the tokens of the same key."""
        return self.epoch << ATTEMPT_BITS | self.attempt

    def __int__(self) -> int:
        return self.value

    def _order(self) -> tuple[int, int, str, str, str, str]:
        return (self.epoch, self.attempt, self.group, self.topic, self.key, self.owner)

    def __lt__(self, other: Any) -> bool:
        if not isinstance(other, FencingToken):
            return NotImplemented
        return self._order() < other._order()


class Ticket(NamedTuple):  # a tuple: one per message on the hot path, cheap to build
    """What an owner holds after a successful claim: the record's identity and its token."""

    group: str
    topic: str
    key: str
    owner: str


@dataclass(slots=True)  # not frozen: one per message, built on the hot path
class Claim:
    """A request to claim one key. ``payload_hash`` empty: no payload check for this one."""

    group: str
    topic: str
    key: str
    owner: str
    payload_hash: str = ""
    lease_s: float = 60.0
    retention_s: float = 86400.0
    check_payload: bool = True

    @property
    def ticket(self) -> Ticket:
        return Ticket(self.group, self.topic, self.key, self.owner)


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """``record``: the record after the claim (the caller's own when it may run, else the
    one that stopped it). ``previous``: the expired claim that was taken over."""

    outcome: Outcome
    record: Record
    previous: Record | None = None

    @property
    def runnable(self) -> bool:
        return self.outcome in (Outcome.CLAIMED, Outcome.TAKEN_OVER)


class Event(NamedTuple):
    at: float
    event: str  # claimed, taken-over, extended, completed, released, fenced-off
    attempt: int
    owner: str


def history_line(now: float, event: str, attempt: int, owner: str) -> str:
    return f"{now:.3f} {event} {attempt} {owner}\n"


def _append(history: str, line: str) -> str:
    return (history + line)[-HISTORY_CHARS:]


def events(rec: Record) -> list[Event]:
    """The record's history, oldest first (the oldest events beyond ``HISTORY_CHARS`` are
    gone; a line cut by that bound is skipped)."""
    lines = rec.history.split("\n")
    if len(rec.history) >= HISTORY_CHARS:
        lines = lines[1:]  # may have lost its beginning
    out = []
    for line in lines:
        parts = line.split(" ", 3)
        if len(parts) == 4:
            try:
                out.append(Event(float(parts[0]), parts[1], int(parts[2]), parts[3]))
            except ValueError:
                continue
    return out


def _with_event(rec: Record, now: float, event: str, owner: str | None = None) -> Record:
    return replace(rec, history=_append(rec.history, history_line(
        now, event, rec.attempt, rec.owner if owner is None else owner)))


def payload_hash(body: bytes) -> str:
    """The hash stored with a claim to tell a re-sent message from another one that reuses
    its key (128-bit BLAKE2b, hex)."""
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def decide_claim(existing: Record | None, claim: Claim, now: float
                 ) -> tuple[ClaimResult, Record | None]:
    """The result of ``claim`` against the stored ``existing`` record, and the record to
    store in its place (None: leave the store as it is)."""
    lease_until = now + claim.lease_s
    if existing is None or not existing.alive(now):
        rec = Record(claim.group, claim.topic, claim.key, Status.CONSUMING, claim.owner, 1,
                     lease_until, claim.payload_hash, now, now, lease_until + claim.retention_s,
                     history_line(now, "claimed", 1, claim.owner))
        return ClaimResult(Outcome.CLAIMED, rec), rec
    if existing.status is Status.RELEASED:  # the redelivery of a failed attempt
        rec = _with_event(replace(
            existing, status=Status.CONSUMING, owner=claim.owner, attempt=existing.attempt + 1,
            lease_until=lease_until, payload_hash=claim.payload_hash or existing.payload_hash,
            updated_at=now, expires_at=lease_until + claim.retention_s), now, "claimed")
        return ClaimResult(Outcome.CLAIMED, rec), rec
    if existing.owner == claim.owner and existing.status is Status.CONSUMING:
        return ClaimResult(Outcome.CLAIMED, existing), None  # a claim retried by its owner
    if (claim.check_payload and claim.payload_hash and existing.payload_hash
            and claim.payload_hash != existing.payload_hash):
        return ClaimResult(Outcome.CONFLICT, existing), None
    if existing.status is Status.CONSUMED:
        return ClaimResult(Outcome.DUPLICATE, existing), None
    if existing.leased(now):
        return ClaimResult(Outcome.BUSY, existing), None
    rec = _with_event(replace(existing, owner=claim.owner, attempt=existing.attempt + 1,
                              lease_until=lease_until, payload_hash=claim.payload_hash or
                              existing.payload_hash, updated_at=now,
                              expires_at=lease_until + claim.retention_s), now, "taken-over")
    return ClaimResult(Outcome.TAKEN_OVER, rec, previous=existing), rec


def _owned(existing: Record | None, owner: str, now: float) -> bool:
    return existing is not None and existing.owner == owner and existing.alive(now)


def _refused(existing: Record | None, owner: str, now: float) -> tuple[bool, Record | None]:
    """A compare-and-set that ``owner`` lost: a record of another owner notes the stale
    owner's attempt as ``fenced-off`` (nothing else changes)."""
    if existing is None or not existing.alive(now) or existing.owner == owner:
        return False, None
    return False, _with_event(existing, now, "fenced-off", owner)


def decide_complete(existing: Record | None, owner: str, now: float, retention_s: float
                    ) -> tuple[bool, Record | None]:
    """Mark ``CONSUMED`` if ``owner`` still owns the record: (won, record to store)."""
    if not _owned(existing, owner, now):
        return _refused(existing, owner, now)
    assert existing is not None
    if existing.status is Status.CONSUMED:  # completed twice by its owner: nothing changes
        return True, None
    if existing.status is Status.RELEASED:
        return False, None
    return True, _with_event(replace(existing, status=Status.CONSUMED, updated_at=now,
                                     expires_at=now + retention_s), now, "completed")


def decide_release(existing: Record | None, owner: str, now: float
                   ) -> tuple[bool, Record | None]:
    """Give ``owner``'s ``CONSUMING`` claim back (``RELEASED``): (won, record to store)."""
    if not _owned(existing, owner, now):
        return _refused(existing, owner, now)
    assert existing is not None
    if existing.status is not Status.CONSUMING:
        return False, None
    return True, _with_event(replace(existing, status=Status.RELEASED, lease_until=now,
                                     updated_at=now), now, "released")


def decide_extend(existing: Record | None, owner: str, now: float, lease_s: float,
                  retention_s: float) -> tuple[bool, Record | None]:
    """Push the lease of ``owner``'s ``CONSUMING`` claim to ``now + lease_s``."""
    if not _owned(existing, owner, now):
        return _refused(existing, owner, now)
    assert existing is not None
    if existing.status is not Status.CONSUMING:
        return False, None
    lease_until = now + lease_s
    return True, _with_event(replace(existing, lease_until=lease_until, updated_at=now,
                                     expires_at=lease_until + retention_s), now, "extended")
