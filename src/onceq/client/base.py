"""What every client has: one broker connection, opened on demand and reopened when lost.

A client given several brokers (``"h1:p1,h2:p2,h3:p3"``, a broker group) talks to the
group's leader (``route.py``): a ``NOT_LEADER`` answer or a lost connection moves it to
the leader, asked of the brokers when the answer does not name it, and ``_call`` tries
the request again there within its timeout. A client given one address behaves as it
always did: no retry, no redirect."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Self

from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.schema import Message
from .connection import BrokerConnection, ConnectionLost, call
from .route import BrokerRoute, cluster_status, follows
from .routes import GroupLinks
from .security import ClientSecurity

log = logging.getLogger("onceq.client")
ELECTION_WAIT_S = 0.1  # between two looks for the leader while nobody leads
# in a group, one attempt of a send waits at most this share of its time budget (at least
# ATTEMPT_MIN_S): an answer lost in a partition (the brokers still name a leader cut off
# from them) leaves time to find the new leader and try there. Not for requests the broker
# may hold on purpose (long polls, lock waits): those keep their whole budget
ATTEMPT_SHARE = 1 / 3
ATTEMPT_MIN_S = 1.0

# opens a connection to ``address`` that hands server pushes to the callback
Connect = Callable[[str, Callable[[int, dict[str, Any]], None]], Awaitable[BrokerConnection]]


class BrokerClient:
    def __init__(self, address: str, connect: Connect | None = None,
                 security: ClientSecurity | None = None) -> None:
        """``address``: ``host:port``, or a broker group's bootstrap list
        ``"h1:p1,h2:p2,..."``; ``security``: the user and TLS (``client/security.py``;
        None: from the environment, ``ONCEQ_USER``...)."""
        self.route = BrokerRoute(address)
        self.security = ClientSecurity.from_env() if security is None else security
        # an in-memory connection in tests
        self._connect = connect or functools.partial(BrokerConnection.open,
                                                     security=self.security)
        self._conn: BrokerConnection | None = None
        self._connect_lock: asyncio.Lock | None = None
        self._no_reconnect = False  # set by clients that must not reopen after closing
        # topics spread over several broker groups: their routes, a link per group
        self.links = GroupLinks(self)

    @property
    def address(self) -> str:
        """The broker this client talks to (in a group: the leader as last known)."""
        return self.route.current

    def _on_push(self, code: int, header: dict[str, Any]) -> None:
        """A push from the broker (clients that care override this)."""

    async def _on_connected(self, conn: BrokerConnection) -> None:
        """A new connection, before any other request uses it (e.g. register first)."""

    async def _connection(self) -> BrokerConnection:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        if self._no_reconnect:
            raise ConnectionLost("the client is closed")
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        # concurrent callers share one new connection: without the lock each would open its
        # own (all but one leaked, never closed)
        async with self._connect_lock:
            if self._conn is None or self._conn.closed:
                conn = await self._open()
                if self.route.group:  # answers of a leader older than one seen: refused
                    conn.fence = self.route
                await self._on_connected(conn)
                self._conn = conn
        return self._conn

    async def _open(self) -> BrokerConnection:
        """A connection to the current broker; in a group, to the leader the others name
        when the current one is out of reach."""
        try:
            return await self._connect(self.address, self._on_push)
        except ConnectionLost:
            if not self.route.group:
                raise
        leader = await self.route.find_leader(self._ask_status)
        if leader is not None:
            self._moved(leader, "the leader")
            return await self._connect(self.address, self._on_push)
        # nobody named a leader (an election, or this user may not read the brokers'
        # status): any broker of the list that answers; a follower's NOT_LEADER then
        # names the leader
        for address in [a for a in self.route.addresses if a != self.address]:
            try:
                conn = await self._connect(address, self._on_push)
            except ConnectionLost:
                continue
            self._moved(address, "a broker of the group")
            return conn
        raise ConnectionLost(f"no broker of {', '.join(self.route.addresses)} leads "
                             "the group (out of reach, or an election is going on)")

    async def _ask_status(self, address: str) -> dict[str, Any] | None:
        return await cluster_status(address, self.security)

    def _moved(self, address: str, why: str) -> None:
        if self.route.move(address):
            log.info("talking to %s at %s from now on", why, address)

    async def _follow(self, exc: OnceqError) -> bool:
        """After ``exc`` from the current broker of a group: move to the leader (named by
        the answer, or asked of the brokers); True when trying again may succeed."""
        if not self.route.group or not follows(exc):
            return False
        if self._conn is not None:
            self._conn.close()  # the next request connects to the (new) leader
        if self.route.redirect(exc):
            log.info("the leader is at %s now", self.address)
            return True
        leader = await self.route.find_leader(self._ask_status)
        if leader is not None and leader != self.address:
            self._moved(leader, "the leader")
        else:  # nobody leads yet, or the current broker does: look again shortly
            await asyncio.sleep(ELECTION_WAIT_S)
        return True

    def _attempt_wait(self, deadline: float, budget: float) -> float:
        """How long one attempt may wait for its answer: what is left of ``budget``
        (which ends at ``deadline``); in a group at most its ``ATTEMPT_SHARE``."""
        left = max(deadline - time.monotonic(), 0.05)
        if self.route.group:
            left = min(left, max(budget * ATTEMPT_SHARE, ATTEMPT_MIN_S))
        return left

    async def _request(self, code: int, header: dict[str, Any] | None = None,
                       payload: bytes = b"", timeout: float | None = 10.0
                       ) -> tuple[dict[str, Any], bytes]:
        conn = await self._connection()
        return await conn.request(code, header, payload, timeout)

    async def _call(self, request: Message, timeout: float | None = 10.0) -> Any:
        """A typed request on this client's connection; its typed reply. In a group, tried
        again on the leader after ``NOT_LEADER`` or a lost connection, within
        ``timeout``."""
        try:
            if not self.route.group:
                return await call(await self._connection(), request, timeout)
            deadline = time.monotonic() + (10.0 if timeout is None else timeout)
            while True:
                try:  # the whole budget: the broker may hold a request (long poll, lock)
                    left = max(deadline - time.monotonic(), 0.05)
                    return await call(await self._connection(), request, left)
                except OnceqError as exc:
                    if time.monotonic() >= deadline or not await self._follow(exc):
                        raise
        except OnceqError as exc:
            if exc.code == ErrorCode.WRONG_GROUP:  # the queue lives on another group
                self.links.wrong_group(getattr(request, "topic", None))
            raise

    async def start(self) -> Self:
        """Connect now (otherwise the first request connects)."""
        await self._connection()
        return self

    async def close(self) -> None:
        await self.links.close()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
