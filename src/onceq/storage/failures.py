"""What the store does when the disk fails it: stable error codes, quiet logs, a usage limit.

* ``storage_error`` maps an ``OSError`` of the write path to a stable wire error:
  ``ENOSPC``/``EDQUOT`` to ``DISK_FULL``, anything else to ``STORAGE_ERROR`` (both
  retriable).
* ``RateLimitedLog`` writes one line per kind of failure and per interval (10 s), with the
  number of repeats it held back, instead of one line (or traceback) per request.
* ``DiskGuard`` refuses writes with ``DISK_FULL`` while the data directory's file system is
  used above a ratio; it asks the file system at most once per interval (clock passed in)
  and lets writes through again by itself once space returns.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable

from ..protocol.errors import ErrorCode, OnceqError

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def storage_error(exc: OSError, what: str) -> OnceqError:
    """The wire error for a failed write: ``what`` says what became of it."""
    reason = exc.strerror or str(exc)
    if is_disk_full(exc):
        return OnceqError(ErrorCode.DISK_FULL, f"disk full ({reason}): {what}")
    return OnceqError(ErrorCode.STORAGE_ERROR, f"storage I/O error ({reason}): {what}")


class RateLimitedLog:
    """At most one log line per ``key`` and ``interval_s``; repeats are counted."""

    def __init__(self, logger: logging.Logger, clock: Callable[[], float],
                 interval_s: float = 10.0) -> None:
        self.logger = logger
        self.clock = clock
        self.interval_s = interval_s
        self._last: dict[str, float] = {}  # key -> time of the last line written
        self._held: dict[str, int] = {}  # key -> repeats held back since that line

    def log(self, level: int, key: str, msg: str, *args: object) -> bool:
        """Log ``msg`` unless ``key`` was logged within the interval; True when written."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        held = self._held.pop(key, 0)
        if held:
            msg += " (and %d more like it in the last %.0fs)"
            args = (*args, held, now - last if last is not None else 0.0)
        self._last[key] = now
        self.logger.log(level, msg, *args)
        return True

    def error(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.ERROR, key, msg, *args)

    def warning(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)


class DiskGuard:
    """Refuse writes while the file system is used above ``max_ratio`` (1.0: never).

    ``usage(path)`` returns ``(total, available)`` bytes of the file system; it is called at
    most once per ``interval_s`` of ``clock``. Above the ratio ``check`` raises ``DISK_FULL``.
    """

    def __init__(self, path: str, max_ratio: float, clock: Callable[[], float],
                 usage: Callable[[str], tuple[int, int]], interval_s: float = 1.0,
                 on_change: Callable[[bool, float], None] | None = None) -> None:
        self.path = path
        self.max_ratio = max_ratio
        self.clock = clock
        self.usage = usage
        self.interval_s = interval_s
        self.on_change = on_change  # (refusing, used ratio) when the state flips
        self.used_ratio = 0.0
        self.refusing = False
        self._next_check = float("-inf")

    def check(self) -> None:
        if self.max_ratio >= 1.0:
            return
        self.refresh()
        if self.refusing:
            raise OnceqError(
                ErrorCode.DISK_FULL,
                f"disk {self.used_ratio:.0%} used, above the limit of {self.max_ratio:.0%}: "
                "writes refused until space is freed")

    def refresh(self) -> None:
        """Measure the usage again if the last measure is older than the interval."""
        now = self.clock()
        if now >= self._next_check:
            self._next_check = now + self.interval_s
            self._measure()

    def _measure(self) -> None:
        try:
            total, avail = self.usage(self.path)
        except OSError:
            return  # cannot tell: keep the last answer
        ratio = 1.0 - avail / total if total > 0 else 0.0
        refusing = ratio > self.max_ratio and self.max_ratio < 1.0
        self.used_ratio = ratio
        if refusing != self.refusing:
            self.refusing = refusing
            if self.on_change is not None:
                self.on_change(refusing, ratio)
