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
    job: Any  # the pull's state (``pull.PullJob``): its ``client`` gives a queue up
    timer: asyncio.TimerHandle | None = None


class PullHold:
    """Held pulls per (topic, queue). ``retry`` re-runs a pull and answers it.

    Each queue's held pulls are an insertion-ordered dict (a set that keeps arrival order),
    so removing one costs O(1) however many a client holds; ``conn.held_pulls`` counts a
    connection's held pulls (``conn.held_pull_added`` is told of each new one: it bounds
    them).
    """

    def __init__(self, retry: Callable[[HeldPull, bool], bool]) -> None:
        self.retry = retry  # (held, final) -> True when answered
        self.held: dict[tuple[str, int], dict[HeldPull, None]] = {}

    def hold(self, key: tuple[str, int], held: HeldPull, seconds: float) -> None:
        self.held.setdefault(key, {})[held] = None
        held.timer = asyncio.get_running_loop().call_later(seconds, self._expire, key, held)
        held.conn.held_pulls += 1
        held.conn.held_pull_added()

    @staticmethod
    def _gone(held: HeldPull) -> None:
        if held.timer is not None:
            held.timer.cancel()
        held.conn.held_pulls -= 1

    def _expire(self, key: tuple[str, int], held: HeldPull) -> None:
        pulls = self.held.get(key)
        if pulls and held in pulls:
            del pulls[held]
            if not pulls:
                del self.held[key]
            held.conn.held_pulls -= 1
            if not held.conn.closed:
                self.retry(held, True)

    def notify(self, key: tuple[str, int]) -> None:
        pulls = self.held.pop(key, None)
        if not pulls:
            return
        keep: dict[HeldPull, None] = {}
        for held in pulls:
            conn = held.conn
            if conn.closed:
                self._gone(held)
            elif conn.write_paused:
                # the client does not read what it was sent: the answer waits (held) until
                # it does (``notify_connection``) or the hold ends, so that many held pulls
                # answered at once do not pile up in the broker's memory
                conn.deferred_pulls = True
                keep[held] = None
            elif self.retry(held, False):
                self._gone(held)
            else:
                keep[held] = None
        if keep:
            self.held.setdefault(key, {}).update(keep)

    def notify_connection(self, conn: Any) -> None:
        """Retry the queues where ``conn`` has held pulls (it reads again)."""
        for key in [k for k, pulls in self.held.items() if any(h.conn is conn for h in pulls)]:
            self.notify(key)

    def connections(self) -> set[Any]:
        """The connections with a held pull."""
        return {h.conn for pulls in self.held.values() for h in pulls}

    def drop_connection(self, conn: Any) -> None:
        if not conn.held_pulls:
            return
        for key in list(self.held):
            pulls = self.held[key]
            for h in [h for h in pulls if h.conn is conn]:
                self._gone(h)
                del pulls[h]
            if not pulls:
                del self.held[key]

    def drop_client(self, key: tuple[str, int], client: str) -> list[HeldPull]:
        """Take ``client``'s held pulls of one queue out (it gave the queue up)."""
        pulls = self.held.get(key)
        if not pulls:
            return []
        dropped = [h for h in pulls if h.job.client == client]
        for h in dropped:
            self._gone(h)
            del pulls[h]
        if not pulls:
            del self.held[key]
        return dropped

    def release_all(self) -> None:
        """Answer every held pull now (shutdown)."""
        for key in list(self.held):
            for held in self.held.pop(key):
                self._gone(held)
                self.retry(held, True)

    def holders_of(self, key: tuple[str, int]) -> list[HeldPull]:
        return list(self.held.get(key, ()))
