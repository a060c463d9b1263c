"""A client's view of topics spread over several broker groups (docs/cluster.md, "Topics
over several groups").

A client given a cluster's bootstrap list asks any broker where a topic's queues live
(``GET_ROUTE``) the first time it names the topic, and keeps the answer for ``ROUTE_TTL_S``;
a ``WRONG_GROUP`` answer (the queue lives elsewhere) or an unknown topic forgets it, so the
next request fetches it again. A request on a queue goes to its group through a link of
its own (a ``BrokerClient`` given that group's members, which follows the group's leader
as any client of a group does); a topic without a route (every queue on one group, or a
standalone broker) goes through the client's own connection, as before. A client given
one address never asks for routes.
"""

from __future__ import annotations

import time
import zlib
from typing import TYPE_CHECKING, Any

from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import RouteInfo, TopicInfo
from ..protocol.requests import GetRoute, GetTopic

if TYPE_CHECKING:
    from ..protocol.schema import Message
    from .base import BrokerClient

ROUTE_TTL_S = 30.0  # a route is fetched again after this long (or at once on WRONG_GROUP)


def routed(info: RouteInfo) -> RouteInfo | None:
    """``info`` when its queues are reached through links: spread over several groups, or
    all on a group other than the one that answered (a topic wholly on the answering
    group is reached like any of its topics, through the owner's connection)."""
    groups = set(info.placement)
    if len(groups) > 1 or (len(groups) == 1 and info.here is not None
                           and info.here not in groups):
        return info
    return None


class GroupLinks:
    def __init__(self, owner: BrokerClient, ttl_s: float = ROUTE_TTL_S) -> None:
        self.owner = owner
        self.ttl_s = ttl_s
        self._routes: dict[str, tuple[RouteInfo | None, float]] = {}
        self._links: dict[str, BrokerClient] = {}
        # a spread topic's route and its queues per group, in the groups' order
        self._group_queues: dict[str, tuple[RouteInfo, list[list[int]]]] = {}
        self.fetched = 0  # GET_ROUTE requests made (stats)
        self.home: str | None = None  # the group of the broker the owner talks to
        self.clustered = False  # a WRONG_GROUP answer was seen

    @property
    def enabled(self) -> bool:
        """Whether routes are asked for: a client given several brokers, or one that was
        answered ``WRONG_GROUP`` (given one broker of a cluster)."""
        return self.owner.route.group or self.clustered

    def wrong_group(self, topic: object) -> None:
        """A ``WRONG_GROUP`` answer: the topic's route moved on (or was never asked for)."""
        self.clustered = True
        if isinstance(topic, str):
            self.forget(topic)

    async def route(self, topic: str) -> RouteInfo | None:
        """The topic's route (None: not spread over several groups)."""
        if not self.enabled:
            return None
        now = time.monotonic()
        cached = self._routes.get(topic)
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            info: RouteInfo = await self.owner._call(GetRoute(topic))
            self.fetched += 1
        except OnceqError as exc:
            if exc.code != ErrorCode.UNKNOWN_REQUEST:  # a broker without routes: none
                raise
            info = RouteInfo(topic)
        if info.here is not None:
            self.home = info.here
        self._routes[topic] = (route := routed(info), now + self.ttl_s)
        return route

    async def key_queues(self, topic: str, key: str) -> list[int] | None:
        """Of a topic spread over several broker groups, the queues of the group ``key``
        (a unique key) belongs to, by its hash (None: not spread): every send of the key,
        a retry or the sender's own after a lost reply, reaches that group's dedup window
        (a window is a group's; round robin over all queues could store it once on each
        group). The queues of each group are kept with the route they came from."""
        route = await self.route(topic)
        if route is None:
            return None
        kept = self._group_queues.get(topic)
        if kept is None or kept[0] is not route:
            groups = sorted(set(route.placement))
            kept = self._group_queues[topic] = (route, [
                [q for q, g in enumerate(route.placement) if g == group] for group in groups])
        by_group = kept[1]
        return by_group[zlib.crc32(key.encode()) % len(by_group)]

    async def queue_count(self, topic: str, written: bool = False) -> int:
        """The topic's queue count: its route's when spread over groups, else the topic's
        (``written``: the queues written to, when fewer are read than written)."""
        route = await self.route(topic)
        if route is not None:
            return len(route.placement)
        info: TopicInfo = await self.owner._call(GetTopic(topic))
        return (info.write_queues or info.queues) if written else info.queues

    def forget(self, topic: str) -> None:
        self._routes.pop(topic, None)

    async def link(self, topic: str, queue: int) -> BrokerClient:
        """The client that reaches ``queue`` of ``topic``: its group's link, or the owner
        for a topic without a route."""
        route = await self.route(topic)
        if route is None or not 0 <= queue < len(route.placement):
            return self.owner
        group = str(route.placement[queue])
        link = self._links.get(group)
        if link is None:
            link = self._links[group] = self._make(group, route.groups.get(group) or {})
        return link

    def _make(self, group: str, where: dict[str, Any]) -> BrokerClient:
        from .base import BrokerClient

        members = [str(a) for a in where.get("members") or []]
        leader = where.get("leader")
        if not members:
            raise OnceqError(ErrorCode.SERVICE_UNAVAILABLE,
                             f"broker group {group!r} has no registered broker")
        link = BrokerClient(",".join(members), security=self.owner.security)
        if isinstance(leader, str) and leader:
            link.route.move(leader)
        return link

    async def call_at(self, topic: str, queue: int, request: Message,
                      timeout: float = 10.0) -> Any:
        """``request`` on ``queue``'s group (fetching the route again after
        ``WRONG_GROUP``), within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            link = await self.link(topic, queue)
            try:
                return await link._call(request, max(deadline - time.monotonic(), 0.05))
            except OnceqError as exc:
                if exc.code != ErrorCode.WRONG_GROUP or time.monotonic() >= deadline:
                    raise
                self.wrong_group(topic)  # (the link's own answer does not reach this cache)

    async def close(self) -> None:
        for link in self._links.values():
            await link.close()
        self._links.clear()
