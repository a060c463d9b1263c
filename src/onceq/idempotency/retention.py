"""How long ``CONSUMED`` records must be kept: at least the broker's redelivery horizon.

A message that fails is retried up to ``max_reconsume`` times (16 by default), retry ``r``
after the delay of level ``3 + r`` (the broker's rule, clamped to its last level). A copy
can therefore arrive that long after the first delivery; a ``CONSUMED`` record purged
sooner would let it run again. With RocketMQ's delay levels the horizon is 17,140 s
(4 h 45 min 40 s); the default retention is one day.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..client.admin import Admin
from ..protocol.errors import OnceqError

__all__ = ["DEFAULT_DELAY_LEVELS_S", "RetentionChecked", "RetentionTooShort",
           "check_against_broker", "check_retention", "redelivery_horizon"]

log = logging.getLogger("onceq.idempotency")

# 1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h, the broker's default
DEFAULT_DELAY_LEVELS_S: tuple[float, ...] = (
    1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600, 7200)


class RetentionTooShort(ValueError):
    """The dedup retention ends before the broker may deliver the last copy."""


def redelivery_horizon(levels: Sequence[float], max_reconsume: int = 16) -> float:
    """Seconds from the first delivery to the last retry of a message that keeps failing
    (the sum of the retry delays; the handlers' own time comes on top)."""
    if not levels:
        raise ValueError("no delay levels")
    n = len(levels)
    return float(sum(levels[max(1, min(3 + r, n)) - 1] for r in range(max_reconsume)))


def check_retention(retention_s: float, levels: Sequence[float], max_reconsume: int = 16,
                    *, strict: bool = True) -> float:
    """Refuse (``strict``) or warn loudly when ``retention_s`` is shorter than the
    redelivery horizon; return the horizon."""
    horizon = redelivery_horizon(levels, max_reconsume)
    if retention_s < horizon:
        msg = (f"dedup retention {retention_s:.0f}s is shorter than the broker's redelivery "
               f"horizon {horizon:.0f}s ({max_reconsume} retries): a retry arriving after "
               "the record is purged would run the handler again; raise retention_s")
        if strict:
            raise RetentionTooShort(msg)
        log.warning("%s", msg)
    return horizon


async def check_against_broker(address: str, retention_s: float, max_reconsume: int, *,
                               strict: bool = True) -> float:
    """``check_retention`` with the delay levels the broker at ``address`` reports (its
    defaults when it cannot be asked); return the horizon."""
    levels: Sequence[float] = DEFAULT_DELAY_LEVELS_S
    try:
        async with Admin(address) as admin:
            status = await admin.broker_status()
        levels = status.get("delay_levels") or levels
    except (OnceqError, OSError) as exc:
        log.warning("could not ask the broker for its delay levels (%s); checking the "
                    "retention against the default levels", exc)
    return check_retention(retention_s, levels, max_reconsume, strict=strict)


class RetentionChecked:
    """A listener whose records must outlive every redelivery: ``PushConsumer.start()``
    calls ``on_consumer_start``, which refuses to start (``strict_retention``) or warns
    loudly when ``retention_s`` is shorter than the broker's redelivery horizon."""

    retention_s: float
    strict_retention: bool
    horizon_s: float | None = None  # the broker's redelivery horizon, once known

    @property
    def onceq_orderly(self) -> bool:
        """An ``@orderly`` handler stays orderly once wrapped."""
        inner = getattr(self, "listener", None) or getattr(self, "handler", None)
        return getattr(inner, "onceq_orderly", False) is True

    async def on_consumer_start(self, consumer: Any) -> None:
        self.horizon_s = await check_against_broker(
            consumer.address, self.retention_s, consumer.config.max_reconsume,
            strict=self.strict_retention)
