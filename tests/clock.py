"""The one fake clock of the test suite: time passes only when a test says so."""

from __future__ import annotations


class FakeClock:
    """A callable clock (seconds) for code that takes ``clock: Callable[[], float]``."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t
