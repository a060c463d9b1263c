"""Failed logins: rate limit and lockout per source address and per user name.

Policy (``FailedLogins``):

* A source address that fails ``max_failures`` logins within ``window_s`` seconds is
  locked out for ``lockout_s``; each further lockout of the same source doubles the time,
  up to ``max_lockout_s``. The doubling resets after ``max_lockout_s`` without a failure.
* A user name is tracked the same way with its own, higher threshold
  (``max_user_failures``): a guess spread over many sources is slowed down too, while one
  noisy source alone locks itself out long before it locks the user out.
* IPv6 sources are counted per /64 network (``ipv6_prefix``): one host usually holds a
  whole /64 and could otherwise change address at every attempt.
* A successful login forgets the failures of that source for that user (a mistyped
  password followed by the right one), never those against other users.
* Memory is bounded: at most ``max_tracked`` sources and as many user names; past that
  the least recently failed entry is forgotten.

The broker calls ``check`` before it verifies a proof (refusing while it returns a
number), then ``failed`` or ``succeeded``. Each lockout is logged (``onceq.auth``).
Not thread-safe: the broker calls it from its event loop.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("onceq.auth")


@dataclass
class _Entry:
    failures: deque[tuple[float, str]] = field(default_factory=deque)  # (time, other key)
    locked_until: float = 0.0
    level: int = 0  # lockouts so far (the next one lasts lockout_s * 2**level)
    last_failure: float = 0.0


class _Tracker:
    """Failures per key, with a threshold, an exponential lockout and an LRU bound."""

    def __init__(self, what: str, threshold: int, limits: FailedLogins) -> None:
        self.what = what
        self.threshold = threshold
        self.limits = limits
        self.entries: OrderedDict[str, _Entry] = OrderedDict()

    def remaining(self, key: str, now: float) -> float | None:
        entry = self.entries.get(key)
        if entry is None or entry.locked_until <= now:
            return None
        return entry.locked_until - now

    def failed(self, key: str, other: str, now: float) -> float | None:
        """Count a failure; the lockout seconds when this one starts a lockout."""
        lim = self.limits
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _Entry()
            while len(self.entries) > lim.max_tracked:
                self.entries.popitem(last=False)
        self.entries.move_to_end(key)
        if entry.level and now - entry.last_failure > lim.max_lockout_s:
            entry.level = 0
        entry.last_failure = now
        while entry.failures and entry.failures[0][0] <= now - lim.window_s:
            entry.failures.popleft()
        entry.failures.append((now, other))
        if len(entry.failures) < self.threshold:
            return None
        seconds = min(lim.lockout_s * 2 ** entry.level, lim.max_lockout_s)
        if seconds < lim.max_lockout_s:  # past the longest lockout the level stops growing
            entry.level += 1
        entry.failures.clear()
        entry.locked_until = max(entry.locked_until, now + seconds)
        return seconds

    def forget(self, key: str, other: str) -> None:
        entry = self.entries.get(key)
        if entry is not None:
            entry.failures = deque(f for f in entry.failures if f[1] != other)


class FailedLogins:
    """Counts failed logins and says how long a source or a user name is locked out.

    ``clock`` is a monotonic clock in seconds (tests pass a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_failures: int = 5,
                 window_s: float = 60.0, lockout_s: float = 30.0,
                 max_lockout_s: float = 3600.0, *, max_user_failures: int = 20,
                 max_tracked: int = 10_000, ipv6_prefix: int = 64) -> None:
        if min(max_failures, max_user_failures, max_tracked) < 1:
            raise ValueError("max_failures, max_user_failures and max_tracked must be >= 1")
        if window_s <= 0 or lockout_s <= 0 or max_lockout_s < lockout_s:
            raise ValueError("need window_s > 0 and 0 < lockout_s <= max_lockout_s")
        if not 0 <= ipv6_prefix <= 128:
            raise ValueError("ipv6_prefix must be within 0..128")
        self.clock = clock
        self.window_s = window_s
        self.lockout_s = lockout_s
        self.max_lockout_s = max_lockout_s
        self.max_tracked = max_tracked
        self.ipv6_prefix = ipv6_prefix
        self._sources = _Tracker("source", max_failures, self)
        self._users = _Tracker("user", max_user_failures, self)

    def source_key(self, source: str) -> str:
        """The key ``source`` is counted under: the address, or its IPv6 /64 network."""
        try:
            addr = ipaddress.ip_address(source.strip("[]"))
        except ValueError:
            return source
        if isinstance(addr, ipaddress.IPv6Address):
            if addr.ipv4_mapped is not None:
                return str(addr.ipv4_mapped)
            net = ipaddress.IPv6Network(f"{addr}/{self.ipv6_prefix}", strict=False)
            return str(net)
        return str(addr)

    def check(self, source: str, user: str | None) -> float | None:
        """Seconds the login must still wait (the longer of the source's and the user's
        lockouts), or None when it may proceed."""
        now = self.clock()
        waits = [self._sources.remaining(self.source_key(source), now)]
        if user is not None:
            waits.append(self._users.remaining(user, now))
        locked = [w for w in waits if w is not None]
        return max(locked) if locked else None

    def failed(self, source: str, user: str | None) -> float | None:
        """Count a failed login; the lockout seconds when it starts one (logged)."""
        now = self.clock()
        src = self.source_key(source)
        name = user or ""
        started = self._sources.failed(src, name, now)
        if started is not None:
            log.warning("login lockout: source %s locked for %.0fs after repeated failed "
                        "logins (last as user %r)", src, started, name)
        user_started = None
        if user is not None:
            user_started = self._users.failed(user, src, now)
            if user_started is not None:
                log.warning("login lockout: user %r locked for %.0fs after repeated failed "
                            "logins (last from %s)", user, user_started, src)
        if started is None:
            return user_started
        return started if user_started is None else max(started, user_started)

    def succeeded(self, source: str, user: str) -> None:
        """Forget the failures of ``source`` logging in as ``user`` (lockouts stand)."""
        src = self.source_key(source)
        self._sources.forget(src, user)
        self._users.forget(user, src)

    def tracked(self) -> tuple[int, int]:
        """How many sources and user names are tracked (for metrics and tests)."""
        return len(self._sources.entries), len(self._users.entries)
