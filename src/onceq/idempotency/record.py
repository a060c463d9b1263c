"""Dedup records and the decisions taken on them (pure: no I/O, time passed in).

A *record* exists per (group, topic, dedup key). Its life:

* ``claim`` of an unknown key inserts it as ``CONSUMING`` with a fresh *owner token*,
  attempt 1 and a lease: the claimer runs the handler.
* ``complete`` by the owner turns it ``CONSUMED``, kept for the retention time: a later
  copy of the message is acknowledged without running the handler.
* ``release`` by the owner (the handler failed) deletes it: the redelivery runs again.
* ``extend`` by the owner pushes the lease forward while a slow handler is alive.

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
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from enum import StrEnum

__all__ = [
    "Claim",
    "ClaimResult",
    "Outcome",
    "Record",
    "Status",
    "Ticket",
    "decide_claim",
    "decide_complete",
    "decide_extend",
    "decide_release",
    "payload_hash",
]


class Status(StrEnum):
    CONSUMING = "CONSUMING"
    CONSUMED = "CONSUMED"


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

    def alive(self, now: float) -> bool:
        """Not past retention (a record that is not alive counts as absent)."""
        return self.expires_at > now

    def leased(self, now: float) -> bool:
        """``CONSUMING`` under a lease that has not expired."""
        return self.status is Status.CONSUMING and self.lease_until > now


@dataclass(frozen=True, slots=True)
class Ticket:
    """What an owner holds after a successful claim: the record's identity and its token."""

    group: str
    topic: str
    key: str
    owner: str


@dataclass(frozen=True, slots=True)
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
                     lease_until, claim.payload_hash, now, now, lease_until + claim.retention_s)
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
    rec = replace(existing, owner=claim.owner, attempt=existing.attempt + 1,
                  lease_until=lease_until, payload_hash=claim.payload_hash or
                  existing.payload_hash, updated_at=now,
                  expires_at=lease_until + claim.retention_s)
    return ClaimResult(Outcome.TAKEN_OVER, rec, previous=existing), rec


def _owned(existing: Record | None, owner: str, now: float) -> bool:
    return existing is not None and existing.owner == owner and existing.alive(now)


def decide_complete(existing: Record | None, owner: str, now: float, retention_s: float
                    ) -> tuple[bool, Record | None]:
    """Mark ``CONSUMED`` if ``owner`` still owns the record: (won, record to store)."""
    if not _owned(existing, owner, now):
        return False, None
    assert existing is not None
    if existing.status is Status.CONSUMED:  # completed twice by its owner: nothing changes
        return True, None
    return True, replace(existing, status=Status.CONSUMED, updated_at=now,
                         expires_at=now + retention_s)


def decide_release(existing: Record | None, owner: str, now: float) -> bool:
    """Whether ``owner`` may delete the record (its claim, still ``CONSUMING``)."""
    return _owned(existing, owner, now) and existing.status is Status.CONSUMING  # type: ignore[union-attr]


def decide_extend(existing: Record | None, owner: str, now: float, lease_s: float,
                  retention_s: float) -> tuple[bool, Record | None]:
    """Push the lease of ``owner``'s ``CONSUMING`` claim to ``now + lease_s``."""
    if not _owned(existing, owner, now) or existing.status is not Status.CONSUMING:  # type: ignore[union-attr]
        return False, None
    assert existing is not None
    lease_until = now + lease_s
    return True, replace(existing, lease_until=lease_until, updated_at=now,
                         expires_at=lease_until + retention_s)
