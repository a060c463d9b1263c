"""Queue allocation strategies for consumer-group rebalancing (RocketMQ model).

Every strategy is a pure function (or callable object) with the signature::

    (current_client_id, all_queues, all_client_ids) -> queues owned by current_client_id

Strategies sort (and de-duplicate) their inputs themselves, so the result depends only on
the *sets* of queues and client ids, never on their order. When every member of a group
runs the same strategy over the same view, each queue is owned by exactly one member
(except :class:`AllocateConfig`, which is a fixed assignment by design).
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "STRATEGIES",
    "AllocateConfig",
    "AllocateConsistentHash",
    "AllocateNearby",
    "AllocateStrategy",
    "MessageQueue",
    "allocate_average",
    "allocate_average_by_circle",
    "get_strategy",
]


@dataclass(frozen=True, order=True, slots=True)
class MessageQueue:
    """A single queue of a topic, ordered by (topic, queue_id)."""

    topic: str
    queue_id: int


AllocateStrategy = Callable[[str, Sequence[MessageQueue], Sequence[str]], list[MessageQueue]]


def _prepare(
    current_client_id: str,
    all_queues: Sequence[MessageQueue],
    all_client_ids: Sequence[str],
) -> tuple[list[MessageQueue], list[str]]:
    """Validate inputs; return (sorted unique queues, sorted unique client ids)."""
    if not isinstance(current_client_id, str) or not current_client_id:
        raise ValueError(f"current_client_id must be a non-empty string, got {current_client_id!r}")
    for cid in all_client_ids:
        if not isinstance(cid, str) or not cid:
            raise ValueError(f"client ids must be non-empty strings, got {cid!r}")
    clients = sorted(set(all_client_ids))
    if current_client_id not in clients:
        raise ValueError(
            f"current client {current_client_id!r} is not in the client list {clients!r}"
        )
    for mq in all_queues:
        if not isinstance(mq, MessageQueue):
            raise ValueError(f"queues must be MessageQueue instances, got {mq!r}")
    return sorted(set(all_queues)), clients


def allocate_average(
    current_client_id: str,
    all_queues: Sequence[MessageQueue],
    all_client_ids: Sequence[str],
) -> list[MessageQueue]:
    """Contiguous blocks: sizes n//m, the first n % m clients get one extra queue."""
    queues, clients = _prepare(current_client_id, all_queues, all_client_ids)
    n, m = len(queues), len(clients)
    index = clients.index(current_client_id)
    base, extra = divmod(n, m)
    start = index * base + min(index, extra)
    size = base + (1 if index < extra else 0)
    return queues[start : start + size]


def allocate_average_by_circle(
    current_client_id: str,
    all_queues: Sequence[MessageQueue],
    all_client_ids: Sequence[str],
) -> list[MessageQueue]:
    """Round-robin: queue j (in sorted order) goes to client j % m."""
    queues, clients = _prepare(current_client_id, all_queues, all_client_ids)
    index = clients.index(current_client_id)
    return queues[index :: len(clients)]


def _hash64(key: str) -> int:
    """First 8 bytes of md5(key) as an unsigned big-endian integer."""
    return int.from_bytes(hashlib.md5(key.encode("utf-8")).digest()[:8], "big")


class AllocateConsistentHash:
    """Consistent-hash ring of clients, ``virtual_nodes`` nodes per client.

    Each queue (key ``f"{topic}@{queue_id}"``) goes to the first node clockwise from its
    hash. Adding a client only moves queues onto that new client.
    """

    def __init__(self, virtual_nodes: int = 10) -> None:
        if isinstance(virtual_nodes, bool) or not isinstance(virtual_nodes, int):
            raise ValueError(f"virtual_nodes must be an int, got {virtual_nodes!r}")
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        self.virtual_nodes = virtual_nodes

    def __repr__(self) -> str:
        return f"AllocateConsistentHash(virtual_nodes={self.virtual_nodes})"

    def __call__(
        self,
        current_client_id: str,
        all_queues: Sequence[MessageQueue],
        all_client_ids: Sequence[str],
    ) -> list[MessageQueue]:
        """Return the queues whose first clockwise ring node belongs to the current client."""
        queues, clients = _prepare(current_client_id, all_queues, all_client_ids)
        if not queues:
            return []
        ring = sorted(
            (_hash64(f"{client}-{i}"), client)
            for client in clients
            for i in range(self.virtual_nodes)
        )
        points = [point for point, _ in ring]
        result = []
        for mq in queues:
            pos = bisect_left(points, _hash64(f"{mq.topic}@{mq.queue_id}"))
            owner = ring[pos % len(ring)][1]
            if owner == current_client_id:
                result.append(mq)
        return result


class AllocateConfig:
    """Fixed assignment: every client gets the configured queues that currently exist."""

    def __init__(self, queues: Sequence[MessageQueue]) -> None:
        configured: list[MessageQueue] = []
        for mq in queues:
            if not isinstance(mq, MessageQueue):
                raise ValueError(f"configured queues must be MessageQueue instances, got {mq!r}")
            if mq not in configured:
                configured.append(mq)
        self.queues: tuple[MessageQueue, ...] = tuple(configured)

    def __repr__(self) -> str:
        return f"AllocateConfig(queues={list(self.queues)!r})"

    def __call__(
        self,
        current_client_id: str,
        all_queues: Sequence[MessageQueue],
        all_client_ids: Sequence[str],
    ) -> list[MessageQueue]:
        """Return the configured queues (in configured order) that exist in ``all_queues``."""
        queues, _ = _prepare(current_client_id, all_queues, all_client_ids)
        existing = set(queues)
        return [mq for mq in self.queues if mq in existing]


class AllocateNearby:
    """Zone-aware allocation (RocketMQ "machine room nearby").

    Queues of a zone that has clients are split among that zone's clients with
    ``fallback``; queues of zones without clients are split among all clients.
    """

    def __init__(
        self,
        client_zone: Callable[[str], str],
        queue_zone: Callable[[MessageQueue], str],
        fallback: AllocateStrategy = allocate_average,
    ) -> None:
        if not callable(client_zone) or not callable(queue_zone) or not callable(fallback):
            raise ValueError("client_zone, queue_zone and fallback must be callables")
        self.client_zone = client_zone
        self.queue_zone = queue_zone
        self.fallback = fallback

    def __repr__(self) -> str:
        return (
            f"AllocateNearby(client_zone={self.client_zone!r}, "
            f"queue_zone={self.queue_zone!r}, fallback={self.fallback!r})"
        )

    def __call__(
        self,
        current_client_id: str,
        all_queues: Sequence[MessageQueue],
        all_client_ids: Sequence[str],
    ) -> list[MessageQueue]:
        """Allocate within the current client's zone, plus a share of client-less zones."""
        queues, clients = _prepare(current_client_id, all_queues, all_client_ids)
        if not queues:
            return []
        clients_by_zone: dict[str, list[str]] = {}
        for cid in clients:
            clients_by_zone.setdefault(self.client_zone(cid), []).append(cid)
        my_zone = self.client_zone(current_client_id)
        local: list[MessageQueue] = []
        orphans: list[MessageQueue] = []
        for mq in queues:
            zone = self.queue_zone(mq)
            if zone == my_zone:
                local.append(mq)
            elif zone not in clients_by_zone:
                orphans.append(mq)
        result = self.fallback(current_client_id, local, clients_by_zone[my_zone])
        result += self.fallback(current_client_id, orphans, clients)
        return sorted(result)


STRATEGIES: dict[str, AllocateStrategy] = {
    "AVERAGE": allocate_average,
    "AVERAGE_BY_CIRCLE": allocate_average_by_circle,
    "CONSISTENT_HASH": AllocateConsistentHash(),
}


def get_strategy(name: str) -> AllocateStrategy:
    """Look up a default strategy by name (case-insensitive)."""
    key = name.strip().upper() if isinstance(name, str) else name
    try:
        return STRATEGIES[key]
    except (KeyError, TypeError):
        valid = ", ".join(sorted(STRATEGIES))
        raise ValueError(f"unknown allocation strategy {name!r}; valid names: {valid}") from None
