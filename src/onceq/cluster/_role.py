"""The pure decisions of the coordination layer: how long a lease may be counted on, and
which role a broker takes given the leader key it observed and its own lease.

Nothing here does I/O or reads a clock: the caller passes ``now`` (seconds of a monotonic
clock), so every rule is tested with a fake clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ._keys import IsrRecord, LeaderRecord


def default_margin(ttl: float) -> float:
    """The safety margin for a lease of ``ttl`` seconds: a fifth of it, at least 0.25 s,
    at most half of it (10 s -> 2 s, 2 s -> 0.4 s, 1 s -> 0.25 s)."""
    return min(max(0.2 * ttl, 0.25), ttl / 2)


def keepalive_interval(ttl: float) -> float:
    """Renew three times per TTL, so two renewals in a row may fail before the margin."""
    return ttl / 3


def retry_interval(ttl: float) -> float:
    """After a failed renewal, try again soon (a tenth of the TTL, 0.1 s at least)."""
    return max(ttl / 10, 0.1)


class LeaseClock:
    """Until when the holder of a lease may count on it, by its own clock.

    etcd expires a lease no earlier than ``ttl`` seconds after it handled the last grant
    or renewal, which it handled after the holder sent it. So the lease is certainly alive
    until ``sent_at + ttl`` on the holder's clock, whatever the network delay; the holder
    stops counting on it ``margin`` seconds earlier, to cover clock-rate differences and
    the time its own loop takes to act (see docs/cluster.md, "Timings").
    """

    def __init__(self, margin: float) -> None:
        if margin < 0:
            raise ValueError("margin must be >= 0")
        self.margin = margin
        self.valid_until: float | None = None  # None: never granted
        self.lost = False

    def renewed(self, sent_at: float, ttl: float) -> None:
        """A grant or renewal sent at ``sent_at`` was answered with ``ttl`` seconds."""
        if self.lost:
            return  # a lost lease is never counted on again, even if a late answer comes
        if ttl <= 0:
            self.lost = True
            return
        until = sent_at + ttl - self.margin
        if self.valid_until is None or until > self.valid_until:
            self.valid_until = until

    def valid(self, now: float) -> bool:
        return not self.lost and self.valid_until is not None and now < self.valid_until

    def remaining(self, now: float) -> float:
        """Seconds left before the lease must no longer be counted on (0 when lost)."""
        if not self.valid(now):
            return 0.0
        assert self.valid_until is not None
        return self.valid_until - now

    def check(self, now: float) -> bool:
        """Mark the lease lost once its time has passed; whether it is still valid."""
        if not self.valid(now):
            self.lost = True
        return not self.lost


class Role(enum.Enum):
    LEADER = "leader"        # the leader key is ours and our lease is valid
    FOLLOWER = "follower"    # another lease holds the leader key
    CANDIDATE = "candidate"  # nobody holds it: campaign
    INACTIVE = "inactive"    # our lease is not valid: neither lead nor campaign


def decide(observed: LeaderRecord | None, own_lease: int, lease_valid: bool) -> Role:
    """The role to take, from the leader key as last observed and our own lease.

    The leader key is ours when it lives under our lease (a leader that restarts gets a
    new lease, so its previous term's key counts as another leader's until it expires).
    """
    if not lease_valid:
        return Role.INACTIVE
    if observed is None:
        return Role.CANDIDATE
    if observed.lease_id == own_lease:
        return Role.LEADER
    return Role.FOLLOWER


def next_epoch(stored: int) -> int:
    """The epoch a candidate claims: one more than the group's stored epoch."""
    return stored + 1


@dataclass(frozen=True)
class Leadership:
    """The fencing token of one leader's term: later code compares epochs with it."""

    broker_id: str
    epoch: int
    lease_id: int
    revision: int  # create revision of the leader key for this term

    @classmethod
    def of(cls, record: LeaderRecord) -> Leadership:
        return cls(record.broker_id, record.epoch, record.lease_id, record.revision)


def is_stale(epoch: int, current_epoch: int) -> bool:
    """Whether a request made under ``epoch`` comes from a leader older than the current
    one: such a request is refused (a replica, a client)."""
    return epoch < current_epoch


def may_campaign(isr: IsrRecord | None, broker_id: str, clean: bool = True) -> bool:
    """Whether a broker may run for leader: with clean elections, only a member of the
    in-sync replicas the last leader published (anyone while none was published: a new
    group, or a group of one); with unclean ones, anyone (acknowledged writes it lacks
    are then lost)."""
    return not clean or isr is None or isr.may_lead(broker_id)
