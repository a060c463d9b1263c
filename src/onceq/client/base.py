"""What every client has: one broker connection, opened on demand and reopened when lost."""

from __future__ import annotations

import asyncio
from typing import Any, Self

from .connection import BrokerConnection


class BrokerClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._conn: BrokerConnection | None = None
        self._connect_lock: asyncio.Lock | None = None

    async def _connection(self) -> BrokerConnection:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:  # concurrent callers share one new connection
            if self._conn is None or self._conn.closed:
                self._conn = await BrokerConnection.open(self.address)
        return self._conn

    async def _request(self, code: int, header: dict[str, Any] | None = None,
                       payload: bytes = b"", timeout: float | None = 10.0
                       ) -> tuple[dict[str, Any], bytes]:
        conn = await self._connection()
        return await conn.request(code, header, payload, timeout)

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
