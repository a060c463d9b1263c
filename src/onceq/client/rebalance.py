"""Rebalance planning and timing (pure; the push consumer drives them with a clock)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .allocation import MessageQueue


@dataclass(frozen=True, slots=True)
class RebalancePlan:
    revoke: list[MessageQueue]  # owned, no longer assigned (or stalled): drain, commit, release
    assign: list[MessageQueue]  # newly assigned: look up the start offset, start pulling


def plan_rebalance(owned: Iterable[MessageQueue], desired: Iterable[MessageQueue],
                   stalled: Iterable[MessageQueue] = ()) -> RebalancePlan:
    """What to revoke and what to take so that the owned set becomes ``desired``.

    A stalled queue (no pull for the pull-expiry time) is dropped and taken again fresh.
    """
    owned_s, desired_s, stalled_s = set(owned), set(desired), set(stalled)
    revoke = sorted((owned_s - desired_s) | (owned_s & stalled_s))
    assign = sorted(desired_s - (owned_s - stalled_s))
    return RebalancePlan(revoke, assign)


class RebalanceTimer:
    """A rebalance is due every ``interval`` seconds, and at once after a notification."""

    __slots__ = ("interval", "last", "notified")

    def __init__(self, interval: float, now: float) -> None:
        self.interval = interval
        self.last = now - interval  # the first check is due at once
        self.notified = False

    def notify(self) -> None:
        self.notified = True

    def due(self, now: float) -> bool:
        # the same float sum as wait_time(): a rebalance is due exactly when there is
        # nothing left to wait (``now - last >= interval`` can disagree by a rounding step,
        # and a loop waiting for the timer would then spin)
        return self.notified or now >= self.last + self.interval

    def done(self, now: float) -> None:
        self.last = now
        self.notified = False

    def wait_time(self, now: float) -> float:
        return 0.0 if self.notified else max(0.0, self.last + self.interval - now)
