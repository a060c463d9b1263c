"""Riding out a broker restart on the source's side.

A call that fails with a retriable error or a lost connection is tried again, after a wait
that starts at 0.05 s and doubles up to 1 s, until the broker has failed every attempt for
the read timeout (option ``readTimeout``); then the source fails with an error that says
so. What is retried is what the sink's writer retries (``client.connection.retriable``), so
both sides of a query ride out the same failures.
"""

from __future__ import annotations

import logging
import time

from ..client.connection import ConnectionLost
from ..protocol.errors import OnceqError

log = logging.getLogger("onceq.spark")

FIRST_DELAY_S = 0.05  # the first wait after a failure, doubled after each further one
MAX_DELAY_S = 1.0


class Backoff:
    """The waits between attempts of one caller, and its time limit: the clock starts at
    the first failure after a success (``ok``), so a broker back within ``timeout_s``
    costs the caller nothing but the wait."""

    def __init__(self, timeout_s: float, what: str) -> None:
        self.timeout_s = timeout_s
        self.what = what  # for messages: what is being done, and where
        self._deadline: float | None = None
        self._delay = FIRST_DELAY_S

    def ok(self) -> None:
        """A call succeeded: the next failure starts a new time limit."""
        self._deadline = None
        self._delay = FIRST_DELAY_S

    def failed(self, exc: OnceqError) -> float:
        """The wait before the next attempt after ``exc`` (retriable); raises the source's
        final error once the time limit has passed."""
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self.timeout_s
            log.warning("onceq: %s: %s; retrying for up to %g s (option readTimeout)",
                        self.what, exc.message, self.timeout_s)
        elif now >= self._deadline:
            raise self.final(exc) from exc
        delay = min(self._delay, max(self._deadline - now, 0.0))
        self._delay = min(self._delay * 2, MAX_DELAY_S)
        return delay

    def final(self, exc: OnceqError) -> OnceqError:
        """The error the source fails with: what it was doing, for how long, the last
        failure; a lost connection stays a ``ConnectionLost``."""
        message = (f"onceq: {self.what}: the broker failed every attempt for "
                   f"{self.timeout_s:g} s (option readTimeout): {exc.message}")
        if isinstance(exc, ConnectionLost):
            return ConnectionLost(message, exc.code)
        return OnceqError(exc.code, message)

