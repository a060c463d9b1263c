"""Consumer-group registry: members, their subscriptions and connections.

A member is identified by its client id inside a group. It expires after
``expiry`` seconds without a heartbeat, or at once when its connection closes. Every change
of a group's membership is reported to a callback so the broker can notify the members.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..protocol.requests import BROADCASTING, CLUSTERING  # noqa: F401 (the names members use)


@dataclass(slots=True)
class Member:
    client_id: str
    conn: Any
    model: str
    subscriptions: dict[str, str]
    last_heartbeat: float
    meta: dict[str, Any] = field(default_factory=dict)


class GroupRegistry:
    def __init__(self, expiry: float, on_change: Callable[[str, str, str], None]) -> None:
        self.expiry = expiry
        self.on_change = on_change  # (group, client_id, reason)
        self.groups: dict[str, dict[str, Member]] = {}

    def heartbeat(
        self, group: str, client_id: str, conn: Any, model: str, subscriptions: dict[str, str],
        now: float, meta: dict[str, Any] | None = None,
    ) -> bool:
        """Register or refresh a member; return True when it joined (or changed)."""
        members = self.groups.setdefault(group, {})
        m = members.get(client_id)
        if m is None or m.conn is not conn:
            members[client_id] = Member(client_id, conn, model, subscriptions, now, meta or {})
            self.on_change(group, client_id, "join")
            return True
        m.last_heartbeat = now
        changed = m.subscriptions != subscriptions
        m.subscriptions = subscriptions
        m.meta = meta or m.meta
        if changed:
            self.on_change(group, client_id, "subscription")
        return changed

    def unregister(self, group: str, client_id: str, reason: str = "leave") -> bool:
        members = self.groups.get(group)
        if not members or client_id not in members:
            return False
        del members[client_id]
        if not members:
            del self.groups[group]
        self.on_change(group, client_id, reason)
        return True

    def drop_connection(self, conn: Any) -> list[tuple[str, str]]:
        gone = [
            (g, cid) for g, members in self.groups.items()
            for cid, m in members.items() if m.conn is conn
        ]
        for g, cid in gone:
            self.unregister(g, cid, "disconnect")
        return gone

    def expire(self, now: float) -> list[tuple[str, str]]:
        gone = [
            (g, cid) for g, members in self.groups.items()
            for cid, m in members.items() if now - m.last_heartbeat > self.expiry
        ]
        for g, cid in gone:
            self.unregister(g, cid, "expired")
        return gone

    def members(self, group: str) -> list[Member]:
        return sorted(self.groups.get(group, {}).values(), key=lambda m: m.client_id)

    def member(self, group: str, client_id: str) -> Member | None:
        return self.groups.get(group, {}).get(client_id)
