"""The dedup store protocol, its errors, an in-memory store and ``open_store(url)``.

Every store applies the rules of ``record`` atomically, one batch per call (one round trip
per listener batch where the store allows it). Time comes from the store's ``clock``
(seconds, wall time by default): consumers sharing a store must have synchronised clocks;
leases of a minute tolerate the usual skew of well under a second.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable
from urllib.parse import parse_qs, urlsplit

from .record import (
    Claim,
    ClaimResult,
    Record,
    Status,
    Ticket,
    decide_claim,
    decide_complete,
    decide_extend,
    decide_release,
    history_line,
)

__all__ = ["DedupStore", "KeyClaim", "MemoryStore", "Purger", "StoreError", "StoreStats",
           "WriteLockTimeout", "claim_keys", "complete_keys", "fresh_record", "open_store"]

log = logging.getLogger("onceq.idempotency")

Clock = Callable[[], float]
MAX_KEY_LEN = 255  # stores keep keys up to this many characters
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,50}")


class StoreError(Exception):
    """The dedup store could not answer (down, timed out, refused): nothing is known about
    the records involved, so a consumer must not act as if a claim had succeeded."""


class WriteLockTimeout(StoreError):
    """An SQLite database's write lock was not obtained within the busy timeout: another
    connection holds a write transaction open. Retriable: the batch is consumed later (not
    acknowledged, nothing of it committed), like any store error; it says nothing about the
    messages themselves. The usual cause is a consumer member stopped inside its
    transaction (SIGSTOP, a long GC pause, a frozen VM): it holds the lock until it runs
    again."""

    def __init__(self, database: str, waited_s: float, busy_timeout_s: float | None,
                 detail: str = "") -> None:
        self.database = database
        self.waited_s = waited_s
        self.busy_timeout_s = busy_timeout_s
        limit = "" if busy_timeout_s is None else f" (busy timeout {busy_timeout_s:g} s)"
        super().__init__(
            f"sqlite database {database}: write lock not obtained after waiting "
            f"{waited_s:.2f} s{limit}; another connection or process holds a write "
            "transaction open, likely a consumer member paused or stopped inside its "
            "transaction (SIGSTOP, GC pause, frozen VM)" + (f" [{detail}]" if detail else ""))


@dataclass(frozen=True, slots=True)
class StoreStats:
    consuming: int  # records CONSUMING (live or expired, not past retention)
    consumed: int  # records CONSUMED within retention
    released: int = 0  # records RELEASED (a failed attempt; the redelivery claims again)


@runtime_checkable
class DedupStore(Protocol):
    """What a dedup store does. Results come in the order of the requests."""

    async def claim_many(self, claims: Sequence[Claim]) -> list[ClaimResult]: ...

    async def complete_many(self, tickets: Sequence[Ticket], retention_s: float
                            ) -> list[bool]: ...

    async def release_many(self, tickets: Sequence[Ticket]) -> list[bool]: ...

    async def extend_many(self, tickets: Sequence[Ticket], lease_s: float,
                          retention_s: float) -> list[bool]: ...

    async def get(self, group: str, topic: str, key: str) -> Record | None: ...

    async def purge_expired(self, limit: int = 1000, updated_before: float = 0.0) -> int:
        """Remove up to ``limit`` records past their retention, and (an operator's choice)
        those last changed before ``updated_before``, whatever their status."""
        ...

    async def stats(self) -> StoreStats: ...

    async def close(self) -> None: ...


# One message's claim on the listener's path: (topic, dedup key, owner token, payload hash).
# The group, the lease, the retention and the payload check are the batch's, given once.
KeyClaim = tuple[str, str, str, str]


def fresh_record(group: str, now: float, lease_s: float, retention_s: float,
                 item: KeyClaim) -> Record:
    """The record that the claim ``item`` of a key that had none wrote at ``now``: what
    ``decide_claim`` of an absent record stores (``CONSUMING``, attempt 1)."""
    topic, key, owner, ph = item
    lease_until = now + lease_s
    return Record(group, topic, key, Status.CONSUMING, owner, 1, lease_until, ph, now, now,
                  lease_until + retention_s, history_line(now, "claimed", 1, owner))


async def claim_keys(store: DedupStore, group: str, items: Sequence[KeyClaim],
                     lease_s: float, retention_s: float, check_payload: bool
                     ) -> tuple[float, dict[int, ClaimResult]]:
    """Claim a batch of keys with as few Python objects as the store allows.

    Returns the store's time of the claim and the results of the claims that did not
    simply create their record: a claim absent from the dict got a fresh record
    (``fresh_record(group, now, ...)``, outcome ``CLAIMED``). A store with a
    ``claim_keys`` method of the same signature answers itself (the SQL and Redis stores:
    no object per message that won); any other store gets ``Claim`` objects through
    ``claim_many``, and every result is in the dict."""
    fast = getattr(store, "claim_keys", None)
    if fast is not None:
        return await fast(group, items, lease_s, retention_s, check_payload)
    results = await store.claim_many([Claim(group, t, k, o, p, lease_s, retention_s,
                                            check_payload) for t, k, o, p in items])
    return 0.0, dict(enumerate(results))


async def complete_keys(store: DedupStore, group: str, items: Sequence[KeyClaim],
                        retention_s: float) -> list[bool]:
    """``complete_many`` of the claims ``items`` (their owner tokens), through the store's
    ``complete_keys`` where it has one (no ``Ticket`` per message)."""
    fast = getattr(store, "complete_keys", None)
    if fast is not None:
        return await fast(group, items, retention_s)
    return await store.complete_many([Ticket(group, t, k, o) for t, k, o, _ in items],
                                     retention_s)


def check_name(name: str, what: str = "table") -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"invalid {what} name {name!r}: letters, digits and _ (max 51)")
    return name


class Purger:
    """Runs ``purge(limit)`` in the background at most every ``interval_s`` (0: never), one
    run at a time, when ``poke()`` is called (from a listener call: no timer to manage)."""

    def __init__(self, purge: Callable[[int], Awaitable[int]], interval_s: float, limit: int,
                 stats: Counter[str]) -> None:
        self.purge = purge
        self.interval_s = interval_s
        self.limit = limit
        self.stats = stats
        self._last = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    def poke(self) -> None:
        if not self.interval_s or (self._task is not None and not self._task.done()):
            return
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            self.stats["purged"] += await self.purge(self.limit)
        except StoreError as exc:
            log.warning("purge of expired dedup records failed: %s", exc)

    async def wait(self) -> None:
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)


class MemoryStore:
    """A store inside one process (tests, single-process tools): the rules of ``record``
    applied to a dict. Records do not survive the process."""

    def __init__(self, clock: Clock = time.time) -> None:
        self.clock = clock
        self._recs: dict[tuple[str, str, str], Record] = {}
        self._replies: dict[tuple[str, str, str], bytes] = {}  # request-reply (replies.py)

    async def claim_many(self, claims: Sequence[Claim]) -> list[ClaimResult]:
        now = self.clock()
        out = []
        for c in claims:
            k = (c.group, c.topic, c.key)
            res, new = decide_claim(self._recs.get(k), c, now)
            if new is not None:
                self._recs[k] = new
            out.append(res)
        return out

    def _cas(self, tickets: Sequence[Ticket], apply: Callable[[Record | None, str, float],
                                                              tuple[bool, Record | None]]
             ) -> list[bool]:
        now = self.clock()
        out = []
        for t in tickets:
            k = (t.group, t.topic, t.key)
            ok, new = apply(self._recs.get(k), t.owner, now)
            if new is not None:
                self._recs[k] = new
            out.append(ok)
        return out

    async def complete_many(self, tickets: Sequence[Ticket], retention_s: float) -> list[bool]:
        return self._cas(tickets, lambda r, o, now: decide_complete(r, o, now, retention_s))

    async def release_many(self, tickets: Sequence[Ticket]) -> list[bool]:
        return self._cas(tickets, decide_release)

    async def extend_many(self, tickets: Sequence[Ticket], lease_s: float,
                          retention_s: float) -> list[bool]:
        return self._cas(tickets,
                         lambda r, o, now: decide_extend(r, o, now, lease_s, retention_s))

    async def get(self, group: str, topic: str, key: str) -> Record | None:
        rec = self._recs.get((group, topic, key))
        return rec if rec is not None and rec.alive(self.clock()) else None

    async def purge_expired(self, limit: int = 1000, updated_before: float = 0.0) -> int:
        now = self.clock()
        dead = [k for k, r in self._recs.items()
                if not r.alive(now) or r.updated_at < updated_before][:limit]
        for k in dead:
            del self._recs[k]
            self._replies.pop(k, None)
        return len(dead)

    async def put_replies(self, group: str, items: Sequence[tuple[str, str, str, bytes]]
                          ) -> list[bool]:
        now = self.clock()
        out = []
        for topic, key, owner, reply in items:
            k = (group, topic, key)
            rec = self._recs.get(k)
            ok = (rec is not None and rec.owner == owner and rec.alive(now)
                  and rec.status is Status.CONSUMING)
            if ok:
                self._replies[k] = bytes(reply)
            out.append(ok)
        return out

    async def get_replies(self, group: str, keys: Sequence[tuple[str, str]]
                          ) -> list[bytes | None]:
        now = self.clock()
        out: list[bytes | None] = []
        for topic, key in keys:
            k = (group, topic, key)
            rec = self._recs.get(k)
            done = rec is not None and rec.alive(now) and rec.status is Status.CONSUMED
            out.append(self._replies.get(k) if done else None)
        return out

    async def stats(self) -> StoreStats:
        now = self.clock()
        live = [r for r in self._recs.values() if r.alive(now)]
        return StoreStats(*(sum(r.status is s for r in live) for s in Status))

    async def close(self) -> None:
        pass


def open_store(url: str, *, clock: Clock = time.time, **options: object) -> DedupStore:
    """A store from its URL; the connection opens on first use.

    * ``memory://`` (one process only)
    * ``sqlite:///relative/path.db``, ``sqlite:////absolute/path.db``, ``sqlite://`` or
      ``sqlite:///:memory:`` (in memory)
    * ``redis://[user:password@]host[:port][/db]``
    * ``mysql://user[:password]@host[:port]/database`` (MariaDB or MySQL)
    * ``postgresql://user[:password]@host[:port]/database``

    ``?table=NAME`` (SQL, default ``onceq_dedup``) or ``?prefix=TEXT`` (Redis, default
    ``onceq:dedup:``) in the URL, or the same as keyword options, keep several users apart.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    opts = {**query, **options}
    if scheme == "memory":
        return MemoryStore(clock)
    if scheme == "sqlite":
        from .sql import SqlStore, sqlite_dialect

        path = url.split("://", 1)[1].split("?", 1)[0]
        path = path[1:] if path.startswith("/") else path
        return SqlStore(sqlite_dialect(path or ":memory:"), clock=clock, **opts)  # type: ignore[arg-type]
    if scheme in ("mysql", "mariadb", "mysql+pymysql"):
        from .sql import SqlStore, mysql_dialect

        return SqlStore(mysql_dialect(parts, multi_statements=True), clock=clock, **opts)  # type: ignore[arg-type]
    if scheme in ("postgresql", "postgres"):
        from .sql import SqlStore, postgres_dialect

        return SqlStore(postgres_dialect(parts), clock=clock, **opts)  # type: ignore[arg-type]
    if scheme in ("redis", "rediss", "unix"):
        from .redis_store import RedisStore

        return RedisStore(url.split("?", 1)[0], clock=clock, **opts)  # type: ignore[arg-type]
    raise ValueError(f"unknown dedup store URL scheme {scheme!r} in {url!r}: use memory, "
                     "sqlite, redis, mysql or postgresql")


async def find_records(url: str, groups: Sequence[str], topic: str, keys: Sequence[str]
                       ) -> list[Record]:
    """The records the store at ``url`` keeps for ``keys`` of ``topic`` in each of
    ``groups`` (what an operator's message lookup shows). ValueError for a URL that names
    no store; StoreError when the store fails."""
    store = open_store(url)
    try:
        out = []
        for group in groups:
            for key in keys:
                rec = await store.get(group, topic, key)
                if rec is not None:
                    out.append(rec)
        return out
    finally:
        await store.close()
