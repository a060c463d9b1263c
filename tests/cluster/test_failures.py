"""Failures around a broker group under load, each checked with the producer's history
(``tests/cluster/history.py``): every acknowledged send read back exactly once, at the
offset its acknowledgement named, and the replicas' logs equal up to the high watermark.

* a follower SIGKILLed and started again on its data directory;
* etcd down (SIGSTOP) for three session TTLs;
* the leader cut off from etcd (a proxy per broker, ``partition.py``);
* the leader cut off from etcd and from its followers, while a client still reaches it.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from onceq.client.message import Message
from onceq.client.producer import Producer
from onceq.protocol.errors import OnceqError
from tests.cluster.failures import etcd_outage, final_check
from tests.cluster.group import Etcd, Node, leader_of, make_group, status
from tests.cluster.history import TOPIC, History, read_back
from tests.cluster.partition import PartitionProxy
from tests.helpers import free_port, wait_until

pytestmark = pytest.mark.timeout(60)

TTL = 2.0  # the groups' session TTL (make_group)


async def _isr(node: Node) -> list[str] | None:
    st = await status(node)
    return None if st is None or st.get("role") != "leader" else list(st["isr"])


def test_follower_killed_and_back_under_load(group: list[Node]) -> None:
    """acks=all, min_insync 2: a follower SIGKILLed under load leaves the ISR and writes
    go on with two in sync; started again on its data directory it catches up and rejoins
    the ISR. No send fails."""

    async def go() -> None:
        leader = await leader_of(group, isr=3)
        follower = next(n for n in group if n is not leader)
        history = History().start(",".join(n.address for n in group), send_timeout=5.0)
        try:
            await history.wait_acked_after(0, 20, 10, "sends acknowledged")
            follower.kill()

            async def isr_without() -> bool:
                isr = await _isr(leader)
                return isr is not None and follower.broker_id not in isr and len(isr) == 2

            await wait_until(isr_without, 5, "the ISR without the killed follower")
            t = time.monotonic()
            await history.wait_acked_after(t, 20, 5, "sends acknowledged with 2 in sync")
            follower.start()

            async def isr_with() -> bool:
                isr = await _isr(leader)
                return isr is not None and follower.broker_id in isr

            await wait_until(isr_with, 10, "the follower back in the ISR")
            await history.wait_acked_after(time.monotonic(), 20, 5, "sends after its return")
        finally:
            await history.finish()
        print({"acknowledged": len(history.acked), "failures": len(history.failures)})
        assert history.failures == [], history.failures
        assert await leader_of(group, isr=3) is leader
        await final_check(group, history)

    asyncio.run(go())


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[Etcd]:
    """An etcd of the test's own, which it may stop."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd is not installed (bash scripts/etcd.sh installs it)")
    (tmp_path / "etcd").mkdir()
    etcd = Etcd(binary, tmp_path / "etcd")
    etcd.start()
    try:
        yield etcd
    finally:
        etcd.stop()


def test_etcd_down(own_etcd: Etcd, tmp_path: Path, cluster_name: str) -> None:
    """etcd stopped (SIGSTOP) for 3 TTLs under load (``failures.etcd_outage``;
    ``benchmarks/cluster_etcd_outage.py`` runs it for 30 s)."""
    nodes = make_group(tmp_path, own_etcd.endpoint, cluster_name)
    try:
        print(asyncio.run(etcd_outage(own_etcd, nodes, 3 * TTL, TTL)))
    finally:
        for n in nodes:
            n.kill()


def test_leader_cut_off_from_etcd(tmp_path: Path, etcd_endpoint: str,
                                  cluster_name: str) -> None:
    """The leader partitioned from etcd (not from its followers) under load: it stops
    serving within TTL, a follower is elected with a higher epoch and sends succeed on it;
    healed, the old leader follows and rejoins the ISR. History: every acknowledged send
    read back once at its offset, the logs equal up to the high watermark."""

    async def go() -> None:
        host, port = etcd_endpoint.rsplit(":", 1)
        proxies = [await PartitionProxy(host, int(port)).start() for _ in range(3)]
        nodes = make_group(tmp_path, etcd_endpoint, cluster_name,
                           etcds=[p.endpoint for p in proxies])
        history = History()
        try:
            old = await leader_of(nodes, isr=3)
            epoch = (await status(old) or {})["epoch"]
            history.start(",".join(n.address for n in nodes), send_timeout=5.0)
            await history.wait_acked_after(0, 20, 10, "sends acknowledged")
            cut = time.monotonic()
            proxies[nodes.index(old)].partition()

            async def stepped_down() -> bool:
                st = await status(old)
                return st is not None and st.get("role") != "leader"

            await wait_until(stepped_down, TTL + 0.5, "the cut-off leader steps down",
                             interval=0.05)
            stepped = time.monotonic()
            others = [n for n in nodes if n is not old]
            new = await leader_of(others, timeout=10)
            st = await status(new)
            assert st is not None and st["epoch"] > epoch
            elected = time.monotonic()
            await history.wait_acked_after(elected, 10, 10, "sends acknowledged by the new leader")
            proxies[nodes.index(old)].heal()

            async def rejoined() -> bool:
                isr = await _isr(new)
                return isr is not None and old.broker_id in isr

            await wait_until(rejoined, 10, "the old leader back in the ISR")
            await history.wait_acked_after(time.monotonic(), 10, 5, "sends after the heal")
            await history.finish()
            print({"acknowledged": len(history.acked), "failures": len(history.failures),
                   "stepped_down_s": round(stepped - cut, 2),
                   "new_leader_s": round(elected - cut, 2)})
            # the old leader answered nothing past its lease: all it acknowledged is on
            # the new leader, once, at the offset it named
            assert all(f.retriable for f in history.failures), history.failures
            await final_check(nodes, history)
        finally:
            await history.finish()
            for n in nodes:
                n.kill()
            for p in proxies:
                await p.close()

    asyncio.run(go())


async def _send_once(address: str, body: str, timeout: float) -> OnceqError | None:
    """One send to the broker at ``address`` alone (no retry, no redirect): its error,
    None when it was acknowledged."""
    async with Producer(address, send_timeout=timeout, retries=0) as p:
        try:
            await p.send(TOPIC, Message(body.encode(), unique_key=body), queue=0)
        except OnceqError as exc:
            return exc
    return None


def test_leader_partitioned_from_etcd_and_followers(tmp_path: Path, etcd_endpoint: str,
                                                    cluster_name: str) -> None:
    """The leader cut off from etcd and from its followers (each broker is advertised
    behind a proxy, which the followers fetch through), while the producer still reaches it
    directly and keeps sending to it: what it stores after the cut is never acknowledged
    (no follower can fetch it), it steps down within TTL, a follower leads with a higher
    epoch and the producer moves there; healed, the old leader cuts its unreplicated tail
    and follows. History: every acknowledged send read back once at its offset, the logs
    equal up to the high watermark."""

    async def go() -> None:
        host, port = etcd_endpoint.rsplit(":", 1)
        to_etcd = [await PartitionProxy(host, int(port)).start() for _ in range(3)]
        ports = [free_port() for _ in range(3)]
        to_broker = [await PartitionProxy("127.0.0.1", p).start() for p in ports]
        nodes = make_group(tmp_path, etcd_endpoint, cluster_name,
                           etcds=[p.endpoint for p in to_etcd], ports=ports,
                           advertised=[p.endpoint for p in to_broker])
        history = History()
        try:
            old = await leader_of(nodes, isr=3)
            i = nodes.index(old)
            epoch = (await status(old) or {})["epoch"]
            # the producer's bootstrap list: the brokers' own ports, the old leader first
            direct = [old.address] + [n.address for n in nodes if n is not old]
            history.start(",".join(direct), send_timeout=8.0)
            await history.wait_acked_after(0, 20, 10, "sends acknowledged")
            cut = time.monotonic()
            to_etcd[i].partition()
            to_broker[i].partition()
            # a client on the old leader's own port: what it sends now is stored there,
            # where no follower can fetch it, and must never be acknowledged
            lone = await _send_once(old.address, "lone", timeout=3.0)
            others = [n for n in nodes if n is not old]
            new = await leader_of(others, timeout=10)
            st = await status(new)
            assert st is not None and st["epoch"] > epoch
            elected = time.monotonic()
            await history.wait_acked_after(elected, 10, 10, "sends acknowledged by the new leader")
            to_etcd[i].heal()
            to_broker[i].heal()

            async def rejoined() -> bool:
                isr = await _isr(new)
                return isr is not None and old.broker_id in isr

            await wait_until(rejoined, 10, "the old leader back in the ISR")
            await history.finish()
            # what the old leader stored after the cut, never acknowledged, cut at the heal
            cuts = re.findall(r"cutting the commit log at (\d+) \(was (\d+)\)",
                              old.stderr.read_text(errors="replace"))
            print({"acknowledged": len(history.acked), "failures": len(history.failures),
                   "new_leader_s": round(elected - cut, 2),
                   "old_leader_tail_cut_bytes": [int(b) - int(a) for a, b in cuts],
                   "lone_send": None if lone is None else lone.message})
            assert lone is not None, "the partitioned leader acknowledged a write"
            assert cuts, "the old leader kept its unreplicated tail"
            assert "lone" not in await read_back((await leader_of(nodes)).address)
            assert all(f.retriable for f in history.failures), history.failures
            await final_check(nodes, history)
        finally:
            await history.finish()
            for n in nodes:
                n.kill()
            for p in to_etcd + to_broker:
                await p.close()

    asyncio.run(go())
