"""What the console remembers between requests: lag samples per group and the last value
of each counter it turns into a rate.

Samples are taken only when a page asks (a page load or an open page's refresh): with no
page open, nothing reads the broker. The memory is bounded: per group at most
``max_points`` samples no older than ``keep_s``, and at most ``max_groups`` groups (the
least recently sampled are forgotten first).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # seconds since the epoch
    values: dict[str, int]  # series label -> value (lag per "topic[queue]")


class History:
    """A bounded time series per key (a consumer group's lag per queue)."""

    def __init__(self, clock: Callable[[], float] = time.time, *, max_points: int = 900,
                 keep_s: float = 1800.0, min_interval_s: float = 0.5,
                 max_groups: int = 64) -> None:
        self.clock = clock
        self.max_points = max_points
        self.keep_s = keep_s
        self.min_interval_s = min_interval_s
        self.max_groups = max_groups
        self._series: OrderedDict[str, deque[Sample]] = OrderedDict()

    def add(self, key: str, values: dict[str, int]) -> None:
        """Record ``values`` now; not when the last sample is younger than
        ``min_interval_s`` (two pages open on one group do not double the points)."""
        now = self.clock()
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = deque(maxlen=self.max_points)
            while len(self._series) > self.max_groups:
                self._series.popitem(last=False)
        self._series.move_to_end(key)
        if series and now - series[-1].t < self.min_interval_s:
            return
        series.append(Sample(now, dict(values)))
        while series and now - series[0].t > self.keep_s:
            series.popleft()

    def series(self, key: str) -> list[Sample]:
        return list(self._series.get(key, ()))


class Rates:
    """Per-second rates of counters, from the previous value the console saw of each."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._last: dict[str, tuple[float, float]] = {}

    def rate(self, key: str, value: float) -> float | None:
        """The rate since the last call for ``key`` (None the first time, or when the
        counter went back: the broker restarted)."""
        now = self.clock()
        prev = self._last.get(key)
        self._last[key] = (now, value)
        if prev is None or now <= prev[0] or value < prev[1]:
            return None
        return (value - prev[1]) / (now - prev[0])
