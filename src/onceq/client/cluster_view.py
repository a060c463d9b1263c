"""The pieces ``onceq cluster status`` (``cli/cluster_cmd.py``) and the console's Cluster
page (``console/cluster.py``) share: each broker's ``BROKER_STATUS`` read with the time it
was read (``read_status``, ``read_statuses``), and, without I/O, a group's load between
two reads of its leader (``group_load``), a member's row (``member_row``) and the queues
moving between groups (``moves``).

A topic's ``placement`` is the group of each of its queues; its ``moving`` entries are
``(queue, group it moves to, phase)``, as a route in etcd has them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias

from ..protocol.errors import OnceqError
from ..protocol.replies import StatusReply
from ..protocol.requests import BrokerStatus
from .connection import BrokerConnection, call
from .security import ClientSecurity

# (monotonic time, a broker's status or None when it was out of reach)
Read: TypeAlias = tuple[float, dict[str, Any] | None]
# per topic, the group of each queue
Placement: TypeAlias = Mapping[str, Sequence[str]]
# per topic, its queues moving: (queue, group it moves to, phase)
Moving: TypeAlias = Mapping[str, Iterable[Sequence[Any]]]


# ---------------------------------------------------------------- reading the brokers
async def read_status(address: str, security: ClientSecurity | None = None,
                      timeout: float = 2.0) -> Read:
    """The broker's ``BROKER_STATUS`` (``log_start``, ``log_end``, ``counts``, ``cluster``)
    and when it was read; None for a broker out of reach."""
    try:
        conn = await BrokerConnection.open(address, timeout=1.0, security=security)
    except (OnceqError, OSError):
        return time.monotonic(), None
    try:
        reply: StatusReply = await call(conn, BrokerStatus(counts=True), timeout)
    except (OnceqError, OSError, TimeoutError):
        return time.monotonic(), None
    finally:
        conn.close()
    return time.monotonic(), {"log_start": reply.log_start, "log_end": reply.log_end,
                              "counts": reply.counts, "cluster": reply.cluster}


async def read_statuses(addresses: Iterable[str], security: ClientSecurity | None = None
                        ) -> dict[str, Read]:
    """``read_status`` of each address, all at once."""
    todo = sorted(set(addresses))
    reads = await asyncio.gather(*(read_status(a, security) for a in todo))
    return dict(zip(todo, reads, strict=True))


# ---------------------------------------------------------------- the view (pure)
def cluster_of(read: Read | None) -> dict[str, Any]:
    """The ``cluster`` section of a read status (empty when out of reach or standalone)."""
    return ((read or (0.0, None))[1] or {}).get("cluster") or {}


def per_second(before: int | None, after: int | None, seconds: float) -> float | None:
    """The rate of a counter between two reads; None when it is unknown or went back (a
    restarted broker, a new leader)."""
    if before is None or after is None or seconds <= 0 or after < before:
        return None
    return (after - before) / seconds


def group_load(group: str, placement: Placement, moving: Moving, before: Read | None,
               now: Read | None) -> dict[str, Any]:
    """A group's load: the queues it holds (in all and per topic), the queues moving out of
    and into it, its leader's stored bytes (``log_end - log_start``, from ``now``) and,
    between two reads of the leader's status (``before``, ``now``), the bytes written,
    messages stored and messages consumed (committed by the consumer groups) per second."""
    by_topic = {t: n for t, groups in placement.items() if (n := groups.count(group))}
    load: dict[str, Any] = {
        "queues": sum(by_topic.values()), "queues_by_topic": by_topic,
        "moving_out": sum(1 for t, ms in moving.items() for q, _to, _ph in ms
                          if placement[t][q] == group),
        "moving_in": sum(1 for ms in moving.values() for _q, to, _ph in ms if to == group),
        "bytes": None, "write_bytes_s": None, "write_msgs_s": None,
        "consume_msgs_s": None, "sampled_s": None}
    if now is None or now[1] is None:
        return load
    st = now[1]
    load["bytes"] = st["log_end"] - st["log_start"]
    if before is None or before[1] is None or now[0] <= before[0]:
        return load
    seconds = now[0] - before[0]
    old, new = before[1].get("counts") or {}, st.get("counts") or {}
    load.update(sampled_s=round(seconds, 3),
                write_bytes_s=per_second(before[1]["log_end"], st["log_end"], seconds),
                write_msgs_s=per_second(old.get("messages"), new.get("messages"), seconds),
                consume_msgs_s=per_second(old.get("consumed"), new.get("consumed"), seconds))
    return load


def member_row(broker_id: str | None, address: str, status: dict[str, Any],
               leader_status: dict[str, Any], is_leader: bool) -> dict[str, Any]:
    """A member of a group: its role, log end, high watermark (its own ``cluster`` status,
    ``status``), lag behind the leader in bytes (0 for the leader) and whether it is in
    the ISR (both from the leader's, ``leader_status``)."""
    lags = leader_status.get("lag") or {}
    return {"broker_id": broker_id, "address": address,
            "role": status.get("role", "unreachable"), "log_end": status.get("log_end"),
            "hw": status.get("hw"), "lag": 0 if is_leader else lags.get(broker_id),
            "in_sync": broker_id is not None
            and broker_id in (leader_status.get("isr") or [])}


def moves(placement: Placement, moving: Moving) -> list[dict[str, Any]]:
    """Each queue moving, by topic: ``{topic, queue, from, to, phase}``."""
    return [{"topic": t, "queue": q, "from": placement[t][q], "to": to, "phase": phase}
            for t, ms in sorted(moving.items()) for q, to, phase in ms]
