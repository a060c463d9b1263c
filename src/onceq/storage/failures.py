"""What the store does when the disk fails it: stable errors, quiet logs, a usage limit.

* ``storage_error`` maps an ``OSError`` of the write path to a store error (``errors.py``):
  ``ENOSPC``/``EDQUOT`` to ``DiskFull``, anything else to ``StoreUnavailable`` (both
  retriable).
* ``RateLimitedLog`` writes one line per kind of failure and per interval (10 s), with the
  number of repeats it held back, instead of one line (or traceback) per request.
* ``DiskGuard`` refuses writes with ``DiskFull`` while the data directory's file system is
  used above a ratio; it asks the file system at most once per interval (clock passed in)
  and lets writes through again by itself once space returns.
* ``WriteGate`` says whether the store accepts writes: refused on a full
  disk, and stopped until a restart after a failure that leaves the files' state unknown (a
  failed write that could not be undone, a failed fsync); reads go on.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .errors import DiskFull, StorageError, StoreUnavailable

if TYPE_CHECKING:
    from .commitlog import CommitLog
    from .consumequeue import ConsumeQueue

log = logging.getLogger("onceq.storage")

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def storage_error(exc: OSError, what: str) -> StorageError:
    """The store error for a failed write: ``what`` says what became of it."""
    reason = exc.strerror or str(exc)
    if is_disk_full(exc):
        return DiskFull(f"disk full ({reason}): {what}")
    return StoreUnavailable(f"storage I/O error ({reason}): {what}")


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
    most once per ``interval_s`` of ``clock``. Above the ratio ``check`` raises ``DiskFull``.
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
            raise DiskFull(
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


def disk_state_changed(refusing: bool, ratio: float, max_ratio: float) -> None:
    """Log a flip of the disk guard's answer."""
    if refusing:
        log.error("store: disk %.1f%% used, above disk_max_used_ratio %.0f%%: writes "
                  "refused with DISK_FULL until space is freed", ratio * 100, max_ratio * 100)
    else:
        log.warning("store: disk %.1f%% used: writes accepted again", ratio * 100)


class WriteGate:
    """Whether the store accepts writes: refused above the disk guard's limit, and stopped
    until a restart after a failure (``write_failure``); reads go on."""

    def __init__(self, log_: CommitLog, queues: dict[tuple[str, int], ConsumeQueue],
                 guard: DiskGuard) -> None:
        self.log = log_
        self.queues = queues
        self.guard = guard
        # set when a failed write could not be undone (or an fsync failed): writes are
        # refused until a restart, reads go on
        self.write_failure: str | None = None

    def check_writable(self, space: bool = True) -> None:
        """Raise unless writes are accepted: not stopped by a failure, and (``space``) the
        disk is used below ``disk_max_used_ratio``."""
        if self.write_failure is not None:
            raise StoreUnavailable("writes refused until the broker restarts: "
                                   f"{self.write_failure}")
        if space:
            self.guard.check()

    def write_state(self) -> dict:
        """Whether writes are accepted, why not, and the disk usage (for the status)."""
        guard = self.guard
        guard.refresh()
        reason = None
        if self.write_failure is not None:
            reason = f"stopped until a restart: {self.write_failure}"
        elif guard.refusing:
            reason = (f"DISK_FULL: disk {guard.used_ratio:.0%} used, above the limit of "
                      f"{guard.max_ratio:.0%}")
        return {"accepted": reason is None, "reason": reason,
                "disk_used": round(guard.used_ratio, 4), "disk_max_used": guard.max_ratio}

    def stop(self, reason: str) -> None:
        """Refuse every later write (reads go on): logged once."""
        if self.write_failure is None:
            self.write_failure = reason
            log.error("store: %s; writes are refused until the broker restarts (reads go "
                      "on)", reason)

    def fail_stop(self, reason: str, rollback_to: int | None = None) -> None:
        """Stop writing after a failed fsync (whose pages' state is unknown).

        ``rollback_to``: a commit-log position up to which everything is known durable;
        every record after it (never acknowledged: sync flush) is removed from the log and
        the indexes, so that it can never be read, nor come back after a restart.
        """
        self.stop(reason)
        if rollback_to is None or rollback_to >= self.log.end:
            return
        try:
            for cq in self.queues.values():
                if cq.max_offset > cq.min_offset:
                    cq.rollback(cq.first_offset_where(0, rollback_to))
            self.log.truncate_to(rollback_to)
        except OSError as exc:
            log.error("store: cannot remove the records after position %d: %s", rollback_to,
                      exc)

    def sync_log(self) -> None:
        """Fsync the commit log; a failure stops writes (see ``fail_stop``)."""
        try:
            self.log.sync()
        except OSError as exc:
            self.stop(f"fsync of the commit log failed: {exc}")
            raise
