"""The cluster's users and grants shared through etcd (``broker/shared_security.py``),
against an in-memory etcd: the first document, taking it, a change written before it is
answered, a failed write undone by the next read, a damaged document ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from onceq.broker.acl import make_grant
from onceq.broker.config import BrokerConfig
from onceq.broker.security import Security
from onceq.broker.shared_security import SharedSecurity, apply_document, encode_document
from onceq.cluster import EtcdUnavailable
from onceq.cluster._etcd import KeyValue
from onceq.storage.config import StoreConfig


class _Etcd:
    """get / create / put of one key, with revisions; ``down`` makes calls fail."""

    def __init__(self) -> None:
        self.kv: dict[bytes, KeyValue] = {}
        self.revision = 1
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise EtcdUnavailable("kv", [("127.0.0.1:2379", "refused")])

    async def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        self._check()
        return self.kv.get(key), self.revision

    async def put(self, key: bytes, value: bytes) -> int:
        self._check()
        self.revision += 1
        self.kv[key] = KeyValue(key, value, 0, self.revision, 1, 0)
        return self.revision

    async def create(self, key: bytes, value: bytes) -> int | None:
        self._check()
        return None if key in self.kv else await self.put(key, value)


def _security(tmp: Path, name: str) -> Security:
    data = tmp / name
    data.mkdir()
    return Security(BrokerConfig(store=StoreConfig(data_dir=str(data)), acl=True),
                    clock=lambda: 1.0)


async def test_one_brokers_users_become_the_clusters_and_changes_reach_the_others(
        tmp_path: Path) -> None:
    etcd = _Etcd()
    a, b = _security(tmp_path, "a"), _security(tmp_path, "b")
    a.users.create("admin", "admin-secret-1", super=True)
    sa = SharedSecurity(etcd, "c1", a)  # type: ignore[arg-type]
    sb = SharedSecurity(etcd, "c1", b)  # type: ignore[arg-type]
    await sb.sync_once()  # nothing in etcd, no users here: nothing written
    assert etcd.kv == {}
    await sa.sync_once()  # the first document: a's users
    await sb.sync_once()
    assert "admin" in b.users and b.users.is_super("admin")
    assert (tmp_path / "b" / "users.json").exists()  # in b's own file too

    a.acls.grant(make_grant("admin", "topic", "orders", ["Pub"]))
    a.users.create("alice", "alice-secret-1")
    await sa.publish()
    await sb.sync_once()
    assert "alice" in b.users and b.acls.list("admin") == a.acls.list("admin")
    assert encode_document(a) == encode_document(b)


async def test_a_change_etcd_did_not_take_is_undone_by_the_next_read(tmp_path: Path) -> None:
    etcd = _Etcd()
    a = _security(tmp_path, "a")
    a.users.create("admin", "admin-secret-1", super=True)
    sa = SharedSecurity(etcd, "c1", a)  # type: ignore[arg-type]
    await sa.sync_once()
    a.users.create("mallory", "mallory-secret-1")
    etcd.down = True
    with pytest.raises(EtcdUnavailable):
        await sa.publish()
    assert "mallory" in a.users  # until etcd is read again
    etcd.down = False
    await sa.sync_once()
    assert "mallory" not in a.users and "admin" in a.users


async def test_a_damaged_document_is_ignored(tmp_path: Path) -> None:
    etcd = _Etcd()
    a = _security(tmp_path, "a")
    a.users.create("admin", "admin-secret-1", super=True)
    sa = SharedSecurity(etcd, "c1", a)  # type: ignore[arg-type]
    await etcd.put(sa.key, b'{"users": {"version": 1, "users": {"x": {}}}, "grants": {}}')
    await sa.sync_once()
    assert list(u["name"] for u in a.users.list()) == ["admin"]
    with pytest.raises(ValueError):
        apply_document(a, b"not json")
    assert not sa.ready  # never read through run(): logins wait
