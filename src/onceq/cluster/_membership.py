"""Broker group membership: registrations under session leases, read and watched.

A broker registers ``/onceq/<cluster>/brokers/<group>/<broker_id>`` under its session's
lease; the key goes away when the broker deregisters, revokes its lease, or stops renewing
it (a crash, a partition) for the lease's TTL.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from ._etcd import EtcdClient
from ._keys import Member, broker_key, brokers_prefix, check_name
from ._session import Session


async def register(session: Session, cluster: str, group: str, broker_id: str,
                   address: str, data: dict[str, Any] | None = None) -> Member:
    """Register (or update) this broker in ``group`` under the session's lease."""
    if not session.valid():
        raise RuntimeError("cannot register under a session that is not valid")
    member = Member(check_name("broker id", broker_id), address, dict(data or {}),
                    session.lease_id)
    await session.client.put(broker_key(cluster, group, broker_id), member.encode(),
                             lease=session.lease_id)
    return member


async def deregister(client: EtcdClient, cluster: str, group: str, broker_id: str) -> None:
    await client.delete(broker_key(cluster, group, broker_id))


@dataclass(frozen=True)
class Members:
    """The members of a group at one etcd revision (watch from ``revision + 1``)."""

    by_id: dict[str, Member]
    revision: int


async def members(client: EtcdClient, cluster: str, group: str) -> Members:
    """The registered members of ``group``, by broker id."""
    prefix = brokers_prefix(cluster, group)
    kvs, revision = await client.range(prefix, prefix=True)
    by_id = {}
    for kv in kvs:
        member = Member.from_kv(kv)
        by_id[member.broker_id] = member
    return Members(by_id, revision)


@dataclass(frozen=True)
class MemberChange:
    kind: Literal["joined", "updated", "left"]
    broker_id: str
    member: Member | None  # None when it left
    revision: int


async def watch_members(client: EtcdClient, cluster: str, group: str, start_revision: int
                        ) -> AsyncIterator[MemberChange]:
    """The changes of ``group``'s membership from ``start_revision`` on (usually
    ``members(...).revision + 1``). Ends with :class:`EtcdError` when the watch breaks:
    read ``members()`` again and watch from its revision."""
    prefix = brokers_prefix(cluster, group)
    async for events in client.watch(prefix, prefix=True, start_revision=start_revision):
        for ev in events:
            broker_id = ev.kv.key[len(prefix):].decode()
            if ev.type == "DELETE":
                yield MemberChange("left", broker_id, None, ev.kv.mod_revision)
            else:
                kind = "joined" if ev.kv.version == 1 else "updated"
                yield MemberChange(kind, broker_id, Member.from_kv(ev.kv), ev.kv.mod_revision)
