"""Long polling: empty pulls wait here until a message arrives or their hold time ends."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, eq=False)
class HeldPull:
    conn: Any
    corr_id: int
    request: dict[str, Any]
    timer: asyncio.TimerHandle | None = None


class PullHold:
    """Held pulls per (topic, queue). ``retry`` re-runs a pull and answers it."""

    def __init__(self, retry: Callable[[HeldPull, bool], bool]) -> None:
        self.retry = retry  # (held, final) -> True when answered
        self.held: dict[tuple[str, int], list[HeldPull]] = {}

    def hold(self, key: tuple[str, int], held: HeldPull, seconds: float) -> None:
        self.held.setdefault(key, []).append(held)
        held.timer = asyncio.get_running_loop().call_later(seconds, self._expire, key, held)

    def _expire(self, key: tuple[str, int], held: HeldPull) -> None:
        lst = self.held.get(key)
        if lst and held in lst:
            lst.remove(held)
            if not lst:
                del self.held[key]
            if not held.conn.closed:
                self.retry(held, True)

    def notify(self, key: tuple[str, int]) -> None:
        lst = self.held.pop(key, None)
        if not lst:
            return
        keep = []
        for held in lst:
            conn = held.conn
            if conn.closed:
                held.timer.cancel()
            elif getattr(conn, "write_paused", False):
                # the client does not read what it was sent: the answer waits (held) until
                # it does (``notify_connection``) or the hold ends, so that many held pulls
                # answered at once do not pile up in the broker's memory
                conn.deferred_pulls = True
                keep.append(held)
            elif self.retry(held, False):
                held.timer.cancel()
            else:
                keep.append(held)
        if keep:
            self.held.setdefault(key, []).extend(keep)

    def notify_connection(self, conn: Any) -> None:
        """Retry the queues where ``conn`` has held pulls (it reads again)."""
        for key in [k for k, lst in self.held.items() if any(h.conn is conn for h in lst)]:
            self.notify(key)

    def connections(self) -> set[Any]:
        """The connections with a held pull."""
        return {h.conn for lst in self.held.values() for h in lst}

    def drop_connection(self, conn: Any) -> None:
        for key in list(self.held):
            lst = self.held[key]
            for h in [h for h in lst if h.conn is conn]:
                h.timer.cancel()
                lst.remove(h)
            if not lst:
                del self.held[key]

    def drop_client(self, key: tuple[str, int], client: str) -> list[HeldPull]:
        """Take ``client``'s held pulls of one queue out (it gave the queue up)."""
        lst = self.held.get(key)
        if not lst:
            return []
        dropped = [h for h in lst if h.request.get("client") == client]
        for h in dropped:
            h.timer.cancel()
            lst.remove(h)
        if not lst:
            del self.held[key]
        return dropped

    def release_all(self) -> None:
        """Answer every held pull now (shutdown)."""
        for key in list(self.held):
            for held in self.held.pop(key):
                held.timer.cancel()
                self.retry(held, True)

    def holders_of(self, key: tuple[str, int]) -> list[HeldPull]:
        return self.held.get(key, [])
