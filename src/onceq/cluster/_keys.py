"""What the coordination layer stores in etcd: the key layout and the values' encoding.

::

    /onceq/<cluster>/brokers/<group>/<broker_id>  a member: JSON {broker_id, address, data},
                                                  under the member's session lease
    /onceq/<cluster>/groups/<group>/leader        the leader: JSON {broker_id, epoch, address},
                                                  under the leader's session lease
    /onceq/<cluster>/groups/<group>/epoch         the group's last leader epoch: a JSON int,
                                                  no lease (it outlives every leader)
    /onceq/<cluster>/groups/<group>/isr           the in-sync replicas the leader published:
                                                  JSON {epoch, leader, members}, no lease
    /onceq/<cluster>/security                     with acl on: the cluster's users and
                                                  grants, JSON {users, grants}, no lease

Values are JSON so that ``etcdctl get --prefix /onceq/`` shows them as they are.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ._etcd import KeyValue

ROOT = "/onceq"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def check_name(kind: str, name: str) -> str:
    """A cluster, group or broker id: 1-128 of ``A-Z a-z 0-9 . _ -`` (no ``/``)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"invalid {kind} {name!r}: use 1-128 of A-Z a-z 0-9 . _ -")
    return name


def brokers_prefix(cluster: str, group: str) -> bytes:
    return (f"{ROOT}/{check_name('cluster', cluster)}/brokers/"
            f"{check_name('group', group)}/").encode()


def broker_key(cluster: str, group: str, broker_id: str) -> bytes:
    return brokers_prefix(cluster, group) + check_name("broker id", broker_id).encode()


def _group_key(cluster: str, group: str, leaf: str) -> bytes:
    return (f"{ROOT}/{check_name('cluster', cluster)}/groups/"
            f"{check_name('group', group)}/{leaf}").encode()


def leader_key(cluster: str, group: str) -> bytes:
    return _group_key(cluster, group, "leader")


def epoch_key(cluster: str, group: str) -> bytes:
    return _group_key(cluster, group, "epoch")


def isr_key(cluster: str, group: str) -> bytes:
    return _group_key(cluster, group, "isr")


def security_key(cluster: str) -> bytes:
    return f"{ROOT}/{check_name('cluster', cluster)}/security".encode()


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def _object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{what} is not JSON: {raw[:80]!r}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not a JSON object: {raw[:80]!r}")
    return value


@dataclass(frozen=True)
class Member:
    """A registered broker: its id, the address clients reach it at, and free data."""

    broker_id: str
    address: str
    data: dict[str, Any] = field(default_factory=dict)
    lease_id: int = 0  # the session lease the registration lives under (0: not read back)

    def encode(self) -> bytes:
        return _json({"broker_id": self.broker_id, "address": self.address,
                      "data": self.data})

    @classmethod
    def from_kv(cls, kv: KeyValue) -> Member:
        value = _object(kv.value, f"member {kv.key!r}")
        return cls(str(value["broker_id"]), str(value["address"]),
                   dict(value.get("data") or {}), kv.lease)


@dataclass(frozen=True)
class LeaderRecord:
    """The leader key as read: who leads, with which epoch, and its fencing token.

    ``revision`` is the leader key's create revision: it changes with every election, and
    together with ``epoch`` and ``lease_id`` it identifies one term of one leader.
    """

    broker_id: str
    epoch: int
    address: str
    lease_id: int
    revision: int

    @staticmethod
    def encode(broker_id: str, epoch: int, address: str) -> bytes:
        return _json({"broker_id": broker_id, "epoch": epoch, "address": address})

    @classmethod
    def from_kv(cls, kv: KeyValue) -> LeaderRecord:
        value = _object(kv.value, f"leader {kv.key!r}")
        return cls(str(value["broker_id"]), int(value["epoch"]), str(value["address"]),
                   kv.lease, kv.create_revision)


@dataclass(frozen=True)
class IsrRecord:
    """The in-sync replicas as the leader of ``epoch`` last published them (the leader
    first). Only these may be elected leader (unless elections are unclean)."""

    epoch: int
    leader: str
    members: tuple[str, ...]

    def encode(self) -> bytes:
        return _json({"epoch": self.epoch, "leader": self.leader,
                      "members": list(self.members)})

    @classmethod
    def from_kv(cls, kv: KeyValue | None) -> IsrRecord | None:
        """The record stored in ``kv``; None when the key is absent (no ISR published)."""
        if kv is None:
            return None
        value = _object(kv.value, f"isr {kv.key!r}")
        return cls(int(value["epoch"]), str(value["leader"]),
                   tuple(str(m) for m in value["members"]))

    def may_lead(self, broker_id: str) -> bool:
        return broker_id in self.members


def encode_epoch(epoch: int) -> bytes:
    return _json(epoch)


def decode_epoch(kv: KeyValue | None) -> int:
    """The epoch stored in the epoch key; 0 when the group never had a leader."""
    if kv is None:
        return 0
    value = json.loads(kv.value)
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"epoch {kv.key!r} holds {kv.value[:40]!r}, not an epoch")
    return value
