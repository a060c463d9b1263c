"""A session: one etcd lease of a broker, renewed in the background until it is lost.

The broker's registration and, when it leads, its leader key live under this lease, so
losing the lease takes both away. The session tells its owner at once (``on_lost``, the
``lost`` event) when it can no longer count on the lease: when etcd says the lease is gone,
or when no renewal succeeded for ``ttl - margin`` seconds by the session's clock, which is
before etcd can expire it. A lost session stays lost: the owner starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

from ._etcd import EtcdClient, EtcdError
from ._role import LeaseClock, default_margin, keepalive_interval, retry_interval

log = logging.getLogger("onceq.cluster")

Clock = Callable[[], float]


class Session:
    """``async with Session(client, ttl=10) as s:`` holds lease ``s.lease_id`` alive."""

    def __init__(self, client: EtcdClient, ttl: float = 10.0, *, margin: float | None = None,
                 clock: Clock = time.monotonic,
                 on_lost: Callable[[str], None] | None = None) -> None:
        if ttl < 1:
            raise ValueError("etcd leases last whole seconds: ttl must be >= 1")
        self.client = client
        self.ttl = float(math.ceil(ttl))
        self.clock = clock
        self._margin_given = margin
        self._margin = default_margin(self.ttl) if margin is None else margin
        if self._margin >= self.ttl:
            raise ValueError(f"margin {self._margin} s leaves nothing of a {self.ttl} s lease")
        self.lease = LeaseClock(self._margin)
        self.lease_id = 0
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self._on_lost = [on_lost] if on_lost else []
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    @property
    def margin(self) -> float:
        return self._margin

    def add_lost_callback(self, callback: Callable[[str], None]) -> None:
        self._on_lost.append(callback)

    def valid(self) -> bool:
        """Whether the lease may be counted on now (checked against the clock)."""
        return not self.lost.is_set() and self.lease.valid(self.clock())

    async def start(self) -> Session:
        """Grant the lease and start renewing it; raises :class:`EtcdError`."""
        sent = self.clock()
        self.lease_id, granted = await self.client.lease_grant(int(self.ttl))
        if granted != self.ttl:  # etcd raises a TTL below its minimum
            self.ttl = float(granted)
            if self._margin_given is None:
                self._margin = self.lease.margin = default_margin(self.ttl)
        self.lease.renewed(sent, self.ttl)
        self._tasks = [asyncio.create_task(self._keep_alive(), name="etcd-keepalive"),
                       asyncio.create_task(self._watchdog(), name="etcd-lease-watchdog")]
        log.info("etcd session: lease %x, ttl %.0f s", self.lease_id, self.ttl)
        return self

    async def __aenter__(self) -> Session:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def mark_lost(self, reason: str) -> None:
        """Stop counting on the lease (e.g. etcd refused a request with it as unknown)."""
        self._lose(reason)

    def _lose(self, reason: str) -> None:
        if self.lost.is_set():
            return
        self.lease.lost = True
        self.lost_reason = reason
        self.lost.set()
        if not self._closing:
            log.warning("etcd session lost (lease %x): %s", self.lease_id, reason)
        for callback in self._on_lost:
            try:
                callback(reason)
            except Exception:
                log.exception("etcd session: lost-callback failed")

    async def _keep_alive(self) -> None:
        while not self.lost.is_set():
            remaining = self.lease.remaining(self.clock())
            sent = self.clock()
            try:
                ttl = await self.client.lease_keepalive(self.lease_id,
                                                        timeout=max(remaining, 0.05))
            except EtcdError as e:
                log.debug("etcd keepalive of lease %x failed: %s", self.lease_id, e)
                await asyncio.sleep(retry_interval(self.ttl))
                continue
            if ttl <= 0:
                self._lose("etcd says the lease is gone")
                return
            self.lease.renewed(sent, ttl)
            await asyncio.sleep(keepalive_interval(self.ttl))

    async def _watchdog(self) -> None:
        while not self.lost.is_set():
            if not self.lease.check(self.clock()):
                self._lose(f"no renewal succeeded within {self.ttl - self.lease.margin:.2f} s "
                           f"(ttl {self.ttl:.0f} s minus margin {self.lease.margin:.2f} s)")
                return
            await asyncio.sleep(max(self.lease.remaining(self.clock()), 0.001))

    async def close(self, *, revoke: bool = True) -> None:
        """Stop renewing; with ``revoke``, revoke the lease so its keys go at once."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        was_valid = self.valid()
        self._lose("session closed")
        if revoke and was_valid and self.lease_id:
            try:
                await self.client.lease_revoke(self.lease_id, timeout=1.0)
            except EtcdError as e:
                log.info("etcd session: revoke of lease %x failed: %s", self.lease_id, e)
