"""Routes: which broker group holds each queue of a topic spread over several groups.

::

    /onceq/<cluster>/routes/<topic>   JSON {"queues": Q, "placement": [group of queue 0, ...],
                                      "version": V, "moving": [[queue, to, phase], ...]},
                                      no lease

A topic's queue ids are global: queue ``i`` lives on group ``placement[i]``, and every
group that holds a queue of the topic knows the topic with all ``Q`` queues (so offsets,
keys and selectors mean the same wherever they are asked), serving only its own. The
placement is made once, when the topic is created (``place``: an even spread over the
groups registered then, or an explicit one), and written only if the topic has no route
yet (create-if-absent: two brokers creating the same topic at once agree on one). A
queue moves to another group by later versions (``onceq topic reassign``, written only
over the version they follow): sealed, handed over, then placed on its new group.

Pure but for the three etcd calls at the end.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._etcd import Compare, EtcdClient, KeyValue, WatchEvent, put_op
from ._keys import ROOT, LeaderRecord, Member, check_name

SEALED, HANDOVER = "sealed", "handover"  # the phases of a queue's move


@dataclass(frozen=True)
class TopicRoute:
    topic: str
    placement: tuple[str, ...]  # the group of each queue
    version: int = 1
    # queues moving to another group (``onceq topic reassign``): (queue, to, phase);
    # SEALED: its group takes no more sends of it; HANDOVER: nor any other request
    moving: tuple[tuple[int, str, str], ...] = ()

    def move_of(self, queue: int) -> tuple[str, str] | None:
        """Where ``queue`` is moving and in which phase (None: it is not moving)."""
        for q, to, phase in self.moving:
            if q == queue:
                return to, phase
        return None

    def with_move(self, queue: int, to: str, phase: str | None) -> TopicRoute:
        """The next version: ``queue`` moving to ``to`` in ``phase``; with ``phase``
        None, moved (placed on ``to``, no longer moving)."""
        moving = tuple(m for m in self.moving if m[0] != queue)
        placement = self.placement
        if phase is None:
            placement = tuple(to if q == queue else g for q, g in enumerate(placement))
        else:
            moving = tuple(sorted((*moving, (queue, to, phase))))
        return TopicRoute(self.topic, placement, self.version + 1, moving)

    @property
    def queues(self) -> int:
        return len(self.placement)

    @property
    def groups(self) -> list[str]:
        """The groups holding queues of the topic, sorted."""
        return sorted(set(self.placement))

    def group_of(self, queue: int) -> str:
        if not 0 <= queue < len(self.placement):
            raise ValueError(f"queue {queue} out of range for topic {self.topic!r} "
                             f"({self.queues} queues)")
        return self.placement[queue]

    def queues_of(self, group: str) -> list[int]:
        return [q for q, g in enumerate(self.placement) if g == group]

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"queues": self.queues, "placement": list(self.placement),
                               "version": self.version}
        if self.moving:
            doc["moving"] = [list(m) for m in self.moving]
        return doc

    @classmethod
    def from_json(cls, topic: str, doc: Any) -> TopicRoute:
        """ValueError for a document that is not a route of ``topic``."""
        try:
            placement = tuple(doc["placement"])
            version = int(doc.get("version", 1))
            if doc["queues"] != len(placement) or not placement:
                raise ValueError("queues and placement disagree")
            for g in placement:
                check_name("group", g)
            moving = tuple((int(q), check_name("group", to), str(phase))
                           for q, to, phase in doc.get("moving") or ())
            if any(not 0 <= q < len(placement) or phase not in (SEALED, HANDOVER)
                   for q, _, phase in moving):
                raise ValueError("a moving queue out of range or in no known phase")
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"route of topic {topic!r}: {exc!r}") from None
        return cls(topic, placement, version, moving)


def place(queues: int, groups: Sequence[str]) -> tuple[str, ...]:
    """An even spread of ``queues`` over ``groups``: queue ``i`` on the ``i % G``-th group
    in name order (each group holds ``Q // G`` or one more)."""
    if queues < 1:
        raise ValueError("a topic has at least one queue")
    names = sorted(set(groups))
    if not names:
        raise ValueError("no broker group is registered: nowhere to place the queues")
    for g in names:
        check_name("group", g)
    return tuple(names[i % len(names)] for i in range(queues))


def route_key(cluster: str, topic: str) -> bytes:
    return f"{routes_prefix(cluster).decode()}{topic}".encode()


def routes_prefix(cluster: str) -> bytes:
    return f"{ROOT}/{check_name('cluster', cluster)}/routes/".encode()


def _decode(cluster: str, kv: KeyValue) -> TopicRoute:
    topic = kv.key.decode()[len(routes_prefix(cluster)):]
    return TopicRoute.from_json(topic, json.loads(kv.value))


async def create_route(client: EtcdClient, cluster: str, route: TopicRoute) -> TopicRoute:
    """Write ``route`` unless the topic has one: the route that holds (this one, or the
    one written first)."""
    key = route_key(cluster, route.topic)
    if await client.create(key, json.dumps(route.to_json()).encode()) is not None:
        return route
    found = await read_route(client, cluster, route.topic)
    if found is None:  # deleted in between: try again once
        return await create_route(client, cluster, route)
    return found


async def replace_route(client: EtcdClient, cluster: str, old: TopicRoute,
                        new: TopicRoute) -> bool:
    """Write ``new`` if the topic's route is still ``old`` (its version): False when
    another change came first."""
    key = route_key(cluster, old.topic)
    kv, _ = await client.get(key)
    if kv is None or _decode(cluster, kv).version != old.version:
        return False
    result = await client.txn([Compare(key, "MOD", "EQUAL", kv.mod_revision)],
                              [put_op(key, json.dumps(new.to_json()).encode())])
    return result.succeeded


async def read_route(client: EtcdClient, cluster: str, topic: str) -> TopicRoute | None:
    kv, _ = await client.get(route_key(cluster, topic))
    return None if kv is None else _decode(cluster, kv)


async def read_routes(client: EtcdClient, cluster: str) -> dict[str, TopicRoute]:
    """Every topic's route (a damaged one is left out)."""
    return (await read_routes_at(client, cluster))[0]


async def read_routes_at(client: EtcdClient, cluster: str
                         ) -> tuple[dict[str, TopicRoute], int]:
    """Every topic's route, and the etcd revision they were read at (to watch from)."""
    kvs, revision = await client.range(routes_prefix(cluster), prefix=True)
    out = {}
    for kv in kvs:
        try:
            r = _decode(cluster, kv)
        except ValueError:
            continue
        out[r.topic] = r
    return out, revision


def apply_events(cluster: str, routes: dict[str, TopicRoute], events: list[WatchEvent]
                 ) -> list[str]:
    """Apply watched changes of the routes prefix to ``routes``; the topics changed (a
    damaged document is left out, as ``read_routes`` does)."""
    changed = []
    prefix = routes_prefix(cluster)
    for ev in events:
        topic = ev.kv.key[len(prefix):].decode()
        if ev.type == "DELETE":
            routes.pop(topic, None)
        else:
            try:
                route = _decode(cluster, ev.kv)
            except ValueError:
                continue
            known = routes.get(topic)
            if known is not None and known.version > route.version:
                continue  # read already in a later version (a re-read under the watch)
            routes[topic] = route
        changed.append(topic)
    return changed



@dataclass(frozen=True)
class GroupDirectory:
    """What a client needs to reach each broker group: its members' addresses and its
    leader's (None while nobody leads)."""

    members: dict[str, list[str]]  # group -> member addresses, by broker id
    leaders: dict[str, str | None]  # group -> the leader's address



async def read_directory(client: EtcdClient, cluster: str) -> GroupDirectory:
    """Every registered group's members and leader, in two range reads."""
    root = f"{ROOT}/{check_name('cluster', cluster)}/"
    members: dict[str, list[tuple[str, str]]] = {}
    kvs, _ = await client.range(f"{root}brokers/".encode(), prefix=True)
    for kv in kvs:
        try:
            m = Member.from_kv(kv)
        except ValueError:
            continue
        group = kv.key.decode()[len(root) + len("brokers/"):].split("/", 1)[0]
        members.setdefault(group, []).append((m.broker_id, m.address))
    leaders: dict[str, str | None] = {g: None for g in members}
    kvs, _ = await client.range(f"{root}groups/".encode(), prefix=True)
    for kv in kvs:
        group, _, leaf = kv.key.decode()[len(root) + len("groups/"):].partition("/")
        if leaf == "leader":
            try:
                leaders[group] = LeaderRecord.from_kv(kv).address
            except ValueError:
                continue
    return GroupDirectory({g: [a for _, a in sorted(ms)] for g, ms in members.items()},
                          leaders)
