"""Administration: topics and consumer groups."""

from __future__ import annotations

from typing import Any

from ..protocol.codes import RequestCode
from .connection import BrokerConnection


class Admin:
    def __init__(self, address: str = "127.0.0.1:9876") -> None:
        self.address = address
        self._conn: BrokerConnection | None = None

    async def __aenter__(self) -> Admin:
        self._conn = await BrokerConnection.open(self.address)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._conn is not None:
            self._conn.close()

    async def _req(self, code: int, header: dict[str, Any] | None = None) -> dict[str, Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await BrokerConnection.open(self.address)
        hdr, _ = await self._conn.request(code, header)
        return hdr

    async def create_topic(self, topic: str, queues: int = 8, *, exclusive: bool = False
                           ) -> dict[str, Any]:
        """Create a topic, or grow its queue count (``exclusive``: fail if it exists)."""
        return await self._req(RequestCode.CREATE_TOPIC,
                               {"topic": topic, "queues": queues, "exclusive": exclusive})

    async def delete_topic(self, topic: str) -> None:
        await self._req(RequestCode.DELETE_TOPIC, {"topic": topic})

    async def list_topics(self) -> list[dict[str, Any]]:
        return (await self._req(RequestCode.LIST_TOPICS))["topics"]

    async def topic_offsets(self, topic: str) -> list[tuple[int, int]]:
        n = int((await self._req(RequestCode.GET_TOPIC, {"topic": topic}))["queues"])
        out = []
        for q in range(n):
            h = await self._req(RequestCode.QUERY_OFFSETS, {"topic": topic, "queue": q})
            out.append((int(h["min"]), int(h["max"])))
        return out

    async def group_offset(self, group: str, topic: str, queue: int) -> int:
        h = await self._req(RequestCode.GET_OFFSET,
                            {"group": group, "topic": topic, "queue": queue})
        return int(h["offset"])

    async def list_groups(self) -> list[str]:
        return (await self._req(RequestCode.LIST_GROUPS))["groups"]

    async def group_members(self, group: str) -> list[dict[str, Any]]:
        return (await self._req(RequestCode.LIST_GROUP_MEMBERS, {"group": group}))["members"]

    async def ping(self) -> int:
        return int((await self._req(RequestCode.PING))["time"])
