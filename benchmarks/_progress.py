"""What a benchmark is running and how far it is, on stderr; its JSON stays on stdout.

``note(msg)`` prints one line; ``Steps(total)`` numbers the runs of a benchmark
(``(3/12) ...``); ``Count(label, total)`` follows a loop and reports at most
every two seconds, then its rate when ``done()``. Every line starts with the script's name
and the seconds since the run started (child processes count from their parent's start)::

    [throughput   12.3s] (3/12) onceq flush=async: batch=100, n=200000, run 1/3
    [throughput   14.3s]   produce batch=100: 61440/200000 (30%), 30712/s
"""

from __future__ import annotations

import os
import sys
import time

# the start of the whole run: child processes inherit it, so their lines share the clock
_T0 = float(os.environ.setdefault("ONCEQ_BENCH_T0", repr(time.time())))
_NAME = os.path.basename(sys.argv[0]).removesuffix(".py") if sys.argv[0] not in ("", "-c") \
    else "child"


def note(msg: str) -> None:
    print(f"[{_NAME} {time.time() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class Steps:
    """Numbered steps of a known count."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0

    def next(self, what: str) -> None:
        self.done += 1
        note(f"({self.done}/{self.total}) {what}")


class Count:
    """Progress of a loop: ``add(n)`` is cheap (a clock read); a line every ``every`` s."""

    __slots__ = ("_next", "_t0", "every", "label", "n", "total")

    def __init__(self, label: str, total: int | None = None, every: float = 2.0) -> None:
        self.label = label
        self.total = total
        self.every = every
        self.n = 0
        self._t0 = time.monotonic()
        self._next = self._t0 + every

    def add(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.every
            self._report(now)

    def _report(self, now: float, final: str = "") -> None:
        of = f"/{self.total} ({100 * self.n // max(self.total, 1)}%)" if self.total else ""
        rate = self.n / max(now - self._t0, 1e-9)
        note(f"  {self.label}: {self.n}{of}, {rate:.0f}/s{final}")

    def done(self) -> None:
        now = time.monotonic()
        self._report(now, f", done in {now - self._t0:.1f}s")
