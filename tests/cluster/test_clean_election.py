"""Clean leader election: the leader publishes its in-sync replicas in etcd, and only
those may be elected. A follower that fell behind (SIGSTOP) and comes back while the
leader dies must not lead; the in-sync follower does, with every acknowledged message."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import urllib.request

import pytest

from tests.cluster.group import Node, leader_of, pull_all, send, status
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(60)


def _etcd_isr(etcd: str, cluster: str) -> dict | None:
    """The ISR key as stored (read through etcd's JSON gateway)."""
    key = base64.b64encode(f"/onceq/{cluster}/groups/g1/isr".encode()).decode()
    req = urllib.request.Request(f"http://{etcd}/v3/kv/range", json.dumps({"key": key}).encode())
    with urllib.request.urlopen(req, timeout=2) as answer:
        kvs = json.loads(answer.read()).get("kvs") or []
    return json.loads(base64.b64decode(kvs[0]["value"])) if kvs else None


def test_stale_follower_is_not_elected(group: list[Node], etcd_endpoint: str,
                                       cluster_name: str) -> None:
    async def go() -> None:
        leader = await leader_of(group, isr=3)
        await wait_until(lambda: len((_etcd_isr(etcd_endpoint, cluster_name) or {})
                                     .get("members", [])) == 3, 5, "the ISR of 3 in etcd")
        stale, fresh = [n for n in group if n is not leader]
        await send(leader.address, "t", "m0", "k0")
        stale.signal(signal.SIGSTOP)
        try:
            def shrunk() -> bool:
                isr = _etcd_isr(etcd_endpoint, cluster_name) or {}
                return sorted(isr.get("members", [])) == sorted([leader.broker_id,
                                                                 fresh.broker_id])

            await wait_until(shrunk, 5, "the stopped follower out of the published ISR")
            # min_insync 2: the leader and the in-sync follower acknowledge these
            acked = [f"m{i}" for i in range(1, 11)]
            for i, body in enumerate(acked, 1):
                assert await send(leader.address, "t", body, f"k{i}") == i
            leader.kill()
        finally:
            stale.signal(signal.SIGCONT)
        new = await leader_of([stale, fresh], timeout=15)
        assert new is fresh
        # the stale one stays a follower, catches up under the new leader and rejoins
        # the ISR (the high watermark waits for it: min_insync 2)
        st = await status(stale)
        assert st is not None and st["role"] == "follower"
        assert "not in the published in-sync replicas" in stale.tail()
        await wait_until(lambda: _in_isr(new, stale), 10, "the stale follower caught up")
        expected = [b"m0"] + [b.encode() for b in acked]

        async def all_acked() -> bool:
            return await pull_all(new.address, "t") == expected

        await wait_until(all_acked, 5, "every acknowledged message on the new leader")
        assert stale.log_bytes() == fresh.log_bytes()

    asyncio.run(go())


async def _in_isr(leader: Node, node: Node) -> bool:
    st = await status(leader)
    return st is not None and node.broker_id in st.get("isr", [])
