"""The etcd client and broker membership against a real etcd (see conftest.py)."""

from __future__ import annotations

import asyncio

import pytest

from onceq.cluster import (
    EtcdClient,
    EtcdRequestError,
    EtcdUnavailable,
    Session,
    members,
    register,
    watch_members,
)
from onceq.cluster._etcd import Compare, put_op, range_op
from tests.cluster.partition import PartitionProxy
from tests.helpers import free_port


async def test_kv_transactions_and_a_prefix_watch(etcd_endpoint, cluster_name):
    client = EtcdClient(etcd_endpoint)
    prefix = f"/onceq/{cluster_name}/kv/".encode()
    first = await client.put(prefix + b"a", b"1")
    events: list = []
    got_two = asyncio.Event()

    async def watch() -> None:
        async for batch in client.watch(prefix, prefix=True, start_revision=first + 1):
            events.extend(batch)
            if len(events) >= 2:
                got_two.set()

    watcher = asyncio.create_task(watch())
    cas = await client.txn([Compare(prefix + b"a", "VALUE", "EQUAL", b"1")],
                           [put_op(prefix + b"a", b"2")], [range_op(prefix + b"a")])
    assert cas.succeeded
    stale = await client.txn([Compare(prefix + b"a", "VALUE", "EQUAL", b"1")],
                             [put_op(prefix + b"a", b"3")], [range_op(prefix + b"a")])
    assert not stale.succeeded and stale.ranges[0][0].value == b"2"
    assert await client.delete(prefix, prefix=True) == 1
    await asyncio.wait_for(got_two.wait(), 5)
    watcher.cancel()
    assert [(e.type, e.kv.value) for e in events] == [("PUT", b"2"), ("DELETE", b"")]
    kvs, _ = await client.range(prefix, prefix=True)
    assert kvs == []


async def test_members_appear_and_disappear_with_their_lease(etcd_endpoint, cluster_name):
    client = EtcdClient(etcd_endpoint)
    before = await members(client, cluster_name, "g1")
    assert before.by_id == {}
    changes: asyncio.Queue = asyncio.Queue()

    async def watch() -> None:
        async for change in watch_members(client, cluster_name, "g1", before.revision + 1):
            await changes.put(change)

    watcher = asyncio.create_task(watch())
    loop = asyncio.get_running_loop()
    crashed = await Session(client, ttl=1).start()
    stays = await Session(client, ttl=2).start()
    await register(crashed, cluster_name, "g1", "b1", "127.0.0.1:9001", {"zone": "a"})
    await register(stays, cluster_name, "g1", "b2", "127.0.0.1:9002")
    seen = [await asyncio.wait_for(changes.get(), 5) for _ in range(2)]
    assert [(c.kind, c.broker_id) for c in seen] == [("joined", "b1"), ("joined", "b2")]
    assert seen[0].member.data == {"zone": "a"}
    now = await members(client, cluster_name, "g1")
    assert {m: (v.address, v.lease_id) for m, v in now.by_id.items()} == {
        "b1": ("127.0.0.1:9001", crashed.lease_id), "b2": ("127.0.0.1:9002", stays.lease_id)}

    stopped = loop.time()
    await crashed.close(revoke=False)  # renewals stop as in a crash: etcd expires the lease
    left = await asyncio.wait_for(changes.get(), 5)
    assert (left.kind, left.broker_id, left.member) == ("left", "b1", None)
    assert loop.time() - stopped < crashed.ttl + 1.0  # etcd checks expiry every 0.5 s
    assert set((await members(client, cluster_name, "g1")).by_id) == {"b2"}

    await stays.close()  # revoked: gone at once
    left = await asyncio.wait_for(changes.get(), 2)
    assert (left.kind, left.broker_id) == ("left", "b2")
    watcher.cancel()


async def test_unreachable_etcd_is_a_clear_error_naming_every_endpoint():
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    client = EtcdClient(",".join(dead), timeout=1)
    with pytest.raises(EtcdUnavailable) as err:
        await client.get(b"/onceq/x")
    message = str(err.value)
    assert all(f"{ep}: connection refused" in message for ep in dead), message
    assert err.value.retriable and [ep for ep, _ in err.value.failures] == dead
    with pytest.raises(EtcdUnavailable):
        await Session(client, ttl=2).start()
    with pytest.raises(EtcdUnavailable):
        async for _ in client.watch(b"/onceq/x"):
            pass


async def test_a_hanging_endpoint_times_out_and_the_next_one_answers(etcd_endpoint):
    host, port = etcd_endpoint.split(":")
    proxy = await PartitionProxy(host, int(port)).start()
    proxy.partition()
    client = EtcdClient([proxy.endpoint, etcd_endpoint], timeout=0.3)
    try:
        kv, revision = await client.get(b"/onceq/none")
        assert kv is None and revision > 0
        alone = EtcdClient(proxy.endpoint, timeout=0.3)
        with pytest.raises(EtcdUnavailable, match=f"{proxy.endpoint}: timed out"):
            await alone.get(b"/onceq/none")
    finally:
        await proxy.close()


async def test_an_unknown_lease_is_a_request_error(etcd_endpoint, cluster_name):
    client = EtcdClient(etcd_endpoint)
    with pytest.raises(EtcdRequestError, match="lease not found") as err:
        await client.put(f"/onceq/{cluster_name}/x".encode(), b"v", lease=12345)
    assert etcd_endpoint in str(err.value) and not err.value.retriable
    assert await client.lease_keepalive(12345) == 0
    await client.lease_revoke(12345)  # an unknown lease is no error
