"""What every client has: one broker connection, opened on demand and reopened when lost."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, Self

from ..protocol.schema import Message
from .connection import BrokerConnection, ConnectionLost, call
from .security import ClientSecurity

# opens a connection to ``address`` that hands server pushes to the callback
Connect = Callable[[str, Callable[[int, dict[str, Any]], None]], Awaitable[BrokerConnection]]


class BrokerClient:
    def __init__(self, address: str, connect: Connect | None = None,
                 security: ClientSecurity | None = None) -> None:
        """``security``: the user and TLS (``client/security.py``; None: from the
        environment, ``ONCEQ_USER``...)."""
        self.address = address
        self.security = ClientSecurity.from_env() if security is None else security
        # an in-memory connection in tests
        self._connect = connect or functools.partial(BrokerConnection.open,
                                                     security=self.security)
        self._conn: BrokerConnection | None = None
        self._connect_lock: asyncio.Lock | None = None
        self._no_reconnect = False  # set by clients that must not reopen after closing

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
                conn = await self._connect(self.address, self._on_push)
                await self._on_connected(conn)
                self._conn = conn
        return self._conn

    async def _request(self, code: int, header: dict[str, Any] | None = None,
                       payload: bytes = b"", timeout: float | None = 10.0
                       ) -> tuple[dict[str, Any], bytes]:
        conn = await self._connection()
        return await conn.request(code, header, payload, timeout)

    async def _call(self, request: Message, timeout: float | None = 10.0) -> Any:
        """A typed request on this client's connection; its typed reply."""
        return await call(await self._connection(), request, timeout)

    async def start(self) -> Self:
        """Connect now (otherwise the first request connects)."""
        await self._connection()
        return self

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
