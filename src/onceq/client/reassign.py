"""Moving a queue of a topic to another broker group (``onceq topic reassign``,
docs/cluster.md "Moving a queue to another group").

The move is a few versions of the topic's route in etcd, each written only over the one
before it, so a move interrupted anywhere is finished by running it again:

1. **sealed**: the queue's group refuses sends to it (``QUEUE_MOVING``: unkeyed sends go
   to another queue at once, keyed ones wait); its consumers keep reading it;
2. its messages are copied to the new group with their offsets (``COPY_QUEUE``: offset
   ``n`` names the same message on both groups);
3. the consumer groups are given ``drain_timeout`` to consume the queue to its end (then
   no message is in flight at the switch);
4. **handover**: the old group refuses every request on the queue; the consumer groups'
   offsets are copied (where higher than the new group's);
5. the queue is placed on the new group: producers and consumers follow its route (the
   brokers tell their consumers at once, ``ROUTE_CHANGED``).

A consumer thus reads the queue's offsets without a gap or a repeat across the move; a
message a consumer had in flight at the handover (drain timed out) is delivered again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from ..cluster import (
    HANDOVER,
    SEALED,
    EtcdClient,
    TopicRoute,
    read_directory,
    read_route,
    read_routes,
    replace_route,
)
from ..log.part import encode_part
from ..log.record import decode_records
from ..protocol.codes import PullStatus
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import PullReply, QueueStateReply, RouteInfo
from ..protocol.requests import CopyQueue, GetRoute, Pull, QueueState
from .base import BrokerClient
from .route import cluster_status
from .security import ClientSecurity

COPY_BATCH = 256  # messages per pull and per copy request


async def reassign(etcd: str, cluster: str, topic: str, queue: int, to: str, *,
                   security: ClientSecurity | None = None, drain_timeout: float = 30.0,
                   say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Move ``queue`` of ``topic`` to broker group ``to``; what was done."""
    client = EtcdClient(etcd)
    route = await read_route(client, cluster, topic)
    if route is None:
        raise OnceqError(ErrorCode.TOPIC_NOT_EXIST, (
            f"topic {topic!r} has no route in cluster {cluster!r}: only a topic created "
            "on a broker of the cluster can have its queues moved"))
    if not 0 <= queue < route.queues:
        raise OnceqError(ErrorCode.INVALID_QUEUE, (
            f"topic {topic!r} has queues 0..{route.queues - 1}, not {queue}"))
    directory = await read_directory(client, cluster)
    if not directory.members.get(to):
        raise OnceqError(ErrorCode.INVALID_ARGUMENT, (
            f"broker group {to!r} has no registered broker in cluster {cluster!r} "
            f"(groups: {', '.join(sorted(directory.members)) or 'none'})"))
    source = route.placement[queue]
    move = route.move_of(queue)
    if move is None and source == to:
        return {"topic": topic, "queue": queue, "moved": False, "group": to}
    if move is not None and move[0] != to:
        raise OnceqError(ErrorCode.INVALID_ARGUMENT, (
            f"queue {queue} of topic {topic!r} is moving to {move[0]!r} already: run "
            f"the reassign to {move[0]!r} again to finish it first"))
    src = BrokerClient(",".join(directory.members[source]), security=security)
    dst = BrokerClient(",".join(directory.members[to]), security=security)
    started = time.monotonic()
    try:
        if move is None:
            route = await _next(client, cluster, route, route.with_move(queue, to, SEALED))
            say(f"queue {queue} of {topic} sealed on {source}")
        await _seen(src, topic, route.version)
        await _seen(dst, topic, route.version)
        copied = 0
        if route.move_of(queue) == (to, SEALED):
            copied = await _copy(src, dst, topic, queue)
            say(f"{copied} message(s) copied to {to}")
            drained = await _drain(src, topic, queue, drain_timeout)
            say("consumer groups drained the queue" if drained else
                f"consumer groups still behind after {drain_timeout}s: handing over")
            route = await _next(client, cluster, route, route.with_move(queue, to, HANDOVER))
            await _seen(src, topic, route.version)
        else:
            drained = False
        state: QueueStateReply = await src._call(QueueState(topic, queue))
        after: QueueStateReply = await dst._call(
            CopyQueue(topic, queue, state.max, dict(state.offsets)))
        if after.max != state.max:
            raise OnceqError(ErrorCode.SYSTEM_ERROR, (
                f"queue {queue} of topic {topic!r} ends at {after.max} on {to!r} but at "
                f"{state.max} on {source!r}: not switched (run the reassign again)"))
        route = await _next(client, cluster, route, route.with_move(queue, to, None))
        await _seen(dst, topic, route.version)
        say(f"queue {queue} of {topic} now on {to}")
        return {"topic": topic, "queue": queue, "moved": True, "from": source, "group": to,
                "copied": copied, "end": state.max, "offsets": dict(state.offsets),
                "drained": drained, "seconds": round(time.monotonic() - started, 3),
                "version": route.version}
    finally:
        await src.close()
        await dst.close()


async def drain_group(etcd: str, cluster: str, group: str, *,
                      security: ClientSecurity | None = None, drain_timeout: float = 30.0,
                      say: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """Move every queue that lives on ``group`` to the other groups (each to the group
    holding the fewest queues of its topic), before the group is removed."""
    client = EtcdClient(etcd)
    directory = await read_directory(client, cluster)
    others = sorted(g for g in directory.members if g != group and directory.members[g])
    if not others:
        raise OnceqError(ErrorCode.INVALID_ARGUMENT, (
            f"no other broker group in cluster {cluster!r} to move {group!r}'s queues to"))
    moved = []
    for topic, route in sorted((await read_routes(client, cluster)).items()):
        for queue in route.queues_of(group):
            route = await read_route(client, cluster, topic) or route
            move = route.move_of(queue)
            to = move[0] if move is not None else min(
                others, key=lambda g: (route.placement.count(g), g))
            moved.append(await reassign(etcd, cluster, topic, queue, to, security=security,
                                        drain_timeout=drain_timeout, say=say))
    return moved


async def _next(client: EtcdClient, cluster: str, old: TopicRoute, new: TopicRoute
                ) -> TopicRoute:
    if not await replace_route(client, cluster, old, new):
        raise OnceqError(ErrorCode.SERVICE_UNAVAILABLE, (
            f"the route of topic {old.topic!r} changed meanwhile (another reassign?): "
            "run the reassign again"))
    return new


async def _seen(broker: BrokerClient, topic: str, version: int, timeout: float = 15.0
                ) -> None:
    """Wait until the group's leader follows route ``version`` (or a later one)."""
    deadline = time.monotonic() + timeout
    while True:
        info: RouteInfo = await broker._call(GetRoute(topic))
        if info.version >= version:
            return
        if time.monotonic() > deadline:
            st = await cluster_status(broker.address, broker.security)
            raise OnceqError(ErrorCode.SERVICE_UNAVAILABLE, (
                f"broker {broker.address} still follows version {info.version} of the "
                f"route of {topic!r} after {timeout}s (etcd out of its reach?); its "
                f"routes: {(st or {}).get('routes')}"))
        await asyncio.sleep(0.05)


async def _copy(src: BrokerClient, dst: BrokerClient, topic: str, queue: int) -> int:
    """Copy the sealed queue's messages the new group lacks; how many were copied. A
    queue whose head went to retention on its group starts on the new group at the first
    message left."""
    copied = 0
    state: QueueStateReply = await dst._call(CopyQueue(topic, queue))
    source: QueueStateReply = await src._call(QueueState(topic, queue))
    end = source.max
    at = state.max
    restart = state.min == state.max < source.min  # nothing here yet: from its first
    if restart:
        at = source.min
        if at == end:  # (none left: the queue's next offset)
            await dst._call(CopyQueue(topic, queue, at, restart=True))
    while at < end:
        reply: PullReply = await src._call(Pull(topic, queue, at, COPY_BATCH))
        if reply.status != PullStatus.FOUND or not reply.payload:
            raise OnceqError(ErrorCode.SYSTEM_ERROR, (
                f"queue {queue} of topic {topic!r} holds no message at {at} on its group "
                f"(its first is past it: messages removed by retention cannot be moved)"))
        parts = [encode_part(m.body, m.unique_key, m.born_ts_ms, m.tags, m.keys,
                             m.properties, 0, m.reconsume_times)
                 for m in decode_records(reply.payload, first=at, end=reply.next)]
        payload = b"".join(len(p).to_bytes(4, "little") + p for p in parts)
        after: QueueStateReply = await dst._call(CopyQueue(topic, queue, at, None, payload,
                                                           restart))
        if after.max != at + len(parts):
            raise OnceqError(ErrorCode.SYSTEM_ERROR, (
                f"copy of queue {queue} of topic {topic!r} from offset {at}: it ends at "
                f"{after.max} on the new group, not {at + len(parts)}"))
        copied += len(parts)
        at = after.max
    return copied


async def _drain(src: BrokerClient, topic: str, queue: int, timeout: float) -> bool:
    """Wait (up to ``timeout``) until every consumer group committed the queue's end."""
    deadline = time.monotonic() + timeout
    while True:
        state: QueueStateReply = await src._call(QueueState(topic, queue))
        if all(o >= state.max for o in state.offsets.values()):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.1)
