"""The leader's view of its followers (Kafka's replica manager, reduced to its rules): each
follower's fetched position, the in-sync replicas and the high watermark. Pure: the time
comes in as an argument.

* A fetch at position ``P`` acknowledges everything before ``P``: the follower's log end
  is ``P``.
* A follower is **caught up** at the time of a fetch at or past the leader's log end then,
  or, when it reaches at least the end the leader had at its previous fetch, at the time
  of that previous fetch (Kafka's ``lastCaughtUpTime``).
* The **in-sync replicas** (ISR) are the leader and the followers caught up within
  ``lag_max_ms``; a follower that stops fetching leaves the ISR ``lag_max_ms`` after it was
  last caught up.
* The **high watermark** is the smallest log end among the ISR and the replicas of the
  ISR last *published* in etcd (``published``), while the ISR has at least
  ``min_insync`` replicas (else it stays); it never goes down within a term. A follower
  that left the ISR still holds the high watermark until the smaller ISR is published:
  any replica etcd may elect has every acknowledged write (Kafka's maximal ISR).
* A new leader counts the followers of the published ISR as caught up at the start of
  its term (``seed``): they leave the ISR only if they do not fetch within
  ``lag_max_ms``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Follower:
    broker_id: str
    position: int = 0  # its log end: it has every record before this
    caught_up_ms: float = float("-inf")
    last_fetch_ms: float = float("-inf")
    last_fetch_leader_end: int = 0


class ReplicaTracker:
    def __init__(self, leader_id: str, lag_max_ms: int, hw: int = 0) -> None:
        self.leader_id = leader_id
        self.lag_max_ms = lag_max_ms
        self.followers: dict[str, Follower] = {}
        self.hw = hw
        self.published: tuple[str, ...] = ()  # the ISR as last published in etcd

    def seed(self, published: tuple[str, ...], live: set[str], now_ms: float) -> None:
        """The term starts from the ISR ``published`` in etcd: its members still
        registered (``live``) count as in sync, their positions unknown (0: they hold the
        high watermark until they fetch); the others are out, but hold the high watermark
        until a smaller ISR is published."""
        self.published = published
        for b in published:
            if b != self.leader_id and b in live and b not in self.followers:
                self.followers[b] = Follower(b, caught_up_ms=now_ms)

    def fetched(self, broker_id: str, position: int, leader_end: int, now_ms: float) -> None:
        """Follower ``broker_id`` fetches from ``position`` while the leader's log ends at
        ``leader_end``."""
        f = self.followers.get(broker_id)
        if f is None:
            f = self.followers[broker_id] = Follower(broker_id)
        f.position = position
        if position >= leader_end:
            f.caught_up_ms = now_ms
        elif position >= f.last_fetch_leader_end:
            f.caught_up_ms = max(f.caught_up_ms, f.last_fetch_ms)
        f.last_fetch_ms = now_ms
        f.last_fetch_leader_end = leader_end

    def in_sync(self, now_ms: float) -> list[str]:
        """The ISR: the leader first, then the followers in sync, by id."""
        live = sorted(f.broker_id for f in self.followers.values()
                      if now_ms - f.caught_up_ms <= self.lag_max_ms)
        return [self.leader_id, *live]

    def advance(self, leader_end: int, now_ms: float, min_insync: int = 1) -> int:
        """The high watermark now (raised, never lowered). It stays where it is while fewer
        than ``min_insync`` replicas are in sync: consumers then see nothing that fewer
        replicas than promised hold."""
        isr = self.in_sync(now_ms)
        if len(isr) < min_insync:
            return self.hw
        holders = (set(isr) | set(self.published)) - {self.leader_id}
        ends = [leader_end] + [self.followers[b].position if b in self.followers else 0
                               for b in holders]
        self.hw = max(self.hw, min(ends))
        return self.hw

    def to_publish(self, now_ms: float) -> list[str] | None:
        """The ISR to publish now, or None when etcd already has it."""
        isr = self.in_sync(now_ms)
        return None if set(isr) == set(self.published) else isr

    def lag(self, leader_end: int) -> dict[str, int]:
        """Bytes each follower is behind the leader's log end."""
        return {b: max(0, leader_end - f.position) for b, f in sorted(self.followers.items())}
