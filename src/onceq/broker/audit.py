"""The audit log: one JSON line per security decision worth keeping.

Written: every login (success and failure, lockouts), every refusal (unauthenticated or
denied), and every allowed change (``Create``, ``Update``, ``Delete``: topics, offsets
resets, dead-letter resends, users, grants). Reads and the data path (``Pub``, ``Sub``,
``Get``, ``List`` allowed) are not written: they would grow the log with the traffic.

A line::

    {"ts": 1718000000.123, "event": "deny", "user": "alice", "source": "10.0.0.5",
     "action": "Delete", "resource": "Topic:orders", "request": "DELETE_TOPIC",
     "id": 17, "reason": "user 'alice' has no grant for Delete on Topic:orders"}

A flood of refusals from one source is rate limited: at most ``burst`` lines at once and
``rate`` a second after that; the lines left out are counted, and the next line from that
source says how many (``"suppressed"``). Metrics count every event, written or not.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TextIO

log = logging.getLogger("onceq.audit")

MAX_SOURCES = 10_000  # rate-limit state kept for at most this many sources


class AuditLog:
    def __init__(self, path: str | None, clock: Callable[[], float] = time.time, *,
                 rate: float = 10.0, burst: float = 50.0) -> None:
        self.path = path
        self.clock = clock
        self.rate, self.burst = rate, burst
        self._out: TextIO | None = None
        self._tokens: dict[str, tuple[float, float, int]] = {}  # source -> tokens, at, left out
        self.counts: dict[str, int] = {}  # event -> count (metrics)
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._out = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def record(self, event: str, *, user: str | None, source: str | None,
               action: str | None = None, resource: str | None = None,
               request: str | None = None, request_id: int | None = None,
               reason: str | None = None) -> None:
        self.counts[event] = self.counts.get(event, 0) + 1
        if self._out is None:
            return
        now = self.clock()
        suppressed = 0
        if event in ("deny", "unauthenticated", "login-failed"):
            allowed, suppressed = self._take(source or "", now)
            if not allowed:
                return
        line: dict[str, Any] = {"ts": round(now, 3), "event": event, "user": user,
                                "source": source}
        for key, value in (("action", action), ("resource", resource), ("request", request),
                           ("id", request_id), ("reason", reason)):
            if value is not None:
                line[key] = value
        if suppressed:
            line["suppressed"] = suppressed
        try:
            self._out.write(json.dumps(line, separators=(",", ":")) + "\n")
        except OSError as exc:  # a full disk must not stop the broker's answers
            log.error("cannot write the audit log %s: %s", self.path, exc)

    def _take(self, source: str, now: float) -> tuple[bool, int]:
        """A token of ``source``'s bucket: (written, lines left out before this one)."""
        tokens, at, left_out = self._tokens.get(source, (self.burst, now, 0))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < 1:
            self._tokens[source] = (tokens, now, left_out + 1)
            return False, 0
        if len(self._tokens) >= MAX_SOURCES and source not in self._tokens:
            self._tokens.pop(next(iter(self._tokens)))
        self._tokens[source] = (tokens - 1, now, 0)
        return True, left_out

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
