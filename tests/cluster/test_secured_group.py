"""A broker group with acl on: followers log in to the leader to replicate (a user with
the cluster's Update grant), the users and grants are the cluster's (one document in etcd,
``broker/shared_security.py``), so users made on one leader work on the next one, and a
follower with a wrong password does not replicate."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from onceq.broker.acl import AclStore, make_grant
from onceq.broker.users import UserStore
from onceq.client.admin import Admin
from onceq.client.message import Message
from onceq.client.producer import Producer
from onceq.client.security import ClientSecurity
from onceq.protocol.errors import ErrorCode, OnceqError
from tests.cluster.group import Node, leader_of, make_group, status
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(90)

ADMIN = ClientSecurity("admin", "admin-secret-1")
REPLICATOR = ("replicator", "replicator-secret-1")


def _seed(data: Path) -> None:
    """The first users and grants, in broker 1's data directory before its first start
    (``onceq user create --data-dir`` does the same): the others take them from etcd."""
    data.mkdir(parents=True)
    users = UserStore(str(data))
    users.create("admin", ADMIN.password or "", super=True)
    users.create(*REPLICATOR)
    acls = AclStore(str(data))
    acls.grant(make_grant(REPLICATOR[0], "cluster", "*", ["Update"]))
    acls.save()


def _credentials(path: Path, user: str, password: str) -> Path:
    path.write_text(f"{user}:{password}\n")
    path.chmod(0o600)
    return path


async def _send(bootstrap: str, security: ClientSecurity, body: str) -> int:
    async with Producer(bootstrap, security=security, send_timeout=10.0) as p:
        return (await p.send("orders", Message(body.encode()), queue=0)).offset


def test_a_secured_group_replicates_and_its_users_survive_a_failover(
        tmp_path: Path, etcd_endpoint: str, cluster_name: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _seed(tmp_path / "b1" / "data")
    creds = _credentials(tmp_path / "replication.cred", *REPLICATOR)
    nodes = make_group(tmp_path, etcd_endpoint, cluster_name, 3, "--acl",
                       "--replication-credentials-file", str(creds))
    # the tests' status probes (group.status) log in as admin from here on
    monkeypatch.setenv("ONCEQ_USER", "admin")
    monkeypatch.setenv("ONCEQ_PASSWORD", ADMIN.password or "")
    async def go() -> None:
        leader = await leader_of(nodes, timeout=20, isr=3)  # followers logged in
        # the leader first: once it is killed, a user who may not read the brokers'
        # status must still find the new leader from the list
        bootstrap = ",".join(n.address for n in sorted(nodes, key=lambda n: n is not leader))
        with pytest.raises(OnceqError) as err:  # nobody gets in without a user
            await _send(bootstrap, ClientSecurity(), "anonymous")
        assert err.value.code == ErrorCode.UNAUTHENTICATED
        async with Admin(bootstrap, security=ADMIN) as admin:
            await admin.create_topic("orders", 1)
            await admin.create_user("alice", "alice-secret-1")
            await admin.grant("alice", "topic", "orders", ["Pub"])
        alice = ClientSecurity("alice", "alice-secret-1")
        assert await _send(bootstrap, alice, "a1") == 0

        leader.kill()
        others = [n for n in nodes if n is not leader]
        await leader_of(others, timeout=20, isr=2)
        # alice and her grant, made on the old leader, hold on the new one
        assert await _send(bootstrap, alice, "a2") == 1
        async with Admin(bootstrap, security=alice) as as_alice:
            with pytest.raises(OnceqError) as err:
                await as_alice.create_topic("other", 1)
        assert err.value.code == ErrorCode.ACCESS_DENIED

        # the old leader back with a wrong replication password: it does not replicate
        bad = _credentials(tmp_path / "bad.cred", REPLICATOR[0], "wrong-password-1")
        leader.args[leader.args.index(str(creds))] = str(bad)
        leader.start()

        async def refused() -> bool:
            st = await status(leader)
            return st is not None and "AUTH_FAILED" in str(st.get("problem"))

        await wait_until(refused, 20, "the follower's login refused")
        st = await status(await leader_of(others, timeout=5))
        assert st is not None and leader.broker_id not in st["isr"]

    try:
        asyncio.run(go())
    finally:
        for n in nodes:
            n.kill()


def test_a_group_with_acl_needs_replication_credentials(tmp_path: Path, etcd_endpoint: str,
                                                        cluster_name: str) -> None:
    node = Node("1", 0, tmp_path / "data", ["--cluster", f"etcd://{etcd_endpoint}",
                                           "--cluster-name", cluster_name, "--group", "g1",
                                           "--broker-id", "1", "--acl"])
    node.start()
    assert node.proc is not None and node.proc.wait(30) == 2
    assert "replication_credentials_file" in node.tail()
    assert os.path.exists(node.stderr)
