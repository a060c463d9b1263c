"""Failures around a broker group under load, each checked with the producer's history
(``tests/cluster/history.py``): every acknowledged send read back exactly once, at the
offset its acknowledgement named, and the replicas' logs equal up to the high watermark.

* a follower SIGKILLed and started again on its data directory;
* etcd down (SIGSTOP) for three session TTLs;
* the leader cut off from etcd (a proxy per broker, ``partition.py``).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from onceq.protocol.errors import ErrorCode
from tests.cluster import chaos
from tests.cluster.group import Etcd, Node, leader_of, make_group, status
from tests.cluster.history import History, check, read_back
from tests.cluster.partition import PartitionProxy
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(60)

TTL = 2.0  # the groups' session TTL (make_group)


async def _isr(node: Node) -> list[str] | None:
    st = await status(node)
    return None if st is None or st.get("role") != "leader" else list(st["isr"])


async def _final_check(nodes: list[Node], history: History) -> None:
    leader = await leader_of(nodes, timeout=10, isr=len(nodes))
    problems = check(history, await read_back(leader.address))
    assert problems == {"lost": [], "stored_twice": [], "moved": []}, problems
    equal, hw = await chaos._replicas_equal(nodes, leader, 10)
    assert equal and hw > 0, "the replicas' logs differ below the high watermark"


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
        await _final_check(group, history)

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
    """etcd stopped (SIGSTOP) for 3 TTLs under load: the leader stops serving within TTL of
    the outage's start (TTL minus the margin after its last renewal), nobody leads while
    etcd is down, and sends fail retriable (NOT_LEADER); etcd back, a leader is elected
    and sends succeed again. Nothing acknowledged is lost or stored twice."""
    nodes = make_group(tmp_path, own_etcd.endpoint, cluster_name)

    async def go() -> None:
        await leader_of(nodes, isr=3)
        history = History().start(",".join(n.address for n in nodes), send_timeout=1.0)
        leaders_seen: list[tuple[float, str]] = []  # (when, broker) seen leading while down
        try:
            await history.wait_acked_after(0, 20, 10, "sends acknowledged")
            down = time.monotonic()
            own_etcd.pause()
            try:
                while time.monotonic() < down + 3 * TTL:
                    for n in nodes:
                        st = await status(n)
                        if st is not None and st.get("role") == "leader":
                            leaders_seen.append((time.monotonic() - down, n.broker_id))
                    await asyncio.sleep(0.1)  # a status sample every 0.1 s
            finally:
                own_etcd.resume()
            up = time.monotonic()
            await leader_of(nodes, timeout=10)
            await history.wait_acked_after(up, 10, 10, "sends acknowledged after etcd is back")
        finally:
            await history.finish()
        print({"acknowledged": len(history.acked), "failures": len(history.failures),
               "leader_seen_until_s": max((t for t, _ in leaders_seen), default=None),
               "acknowledged_during_outage": sum(1 for _, _, a in history.acked.values()
                                                 if down < a < up)})
        late_acks = [k for k, (_, _, acked) in history.acked.items() if down + TTL < acked < up]
        assert late_acks == [], "writes acknowledged after the lease could have expired"
        assert all(t < TTL for t, _ in leaders_seen), leaders_seen
        down_failures = [f for f in history.failures if down < f.at < up + 0.5]
        assert down_failures, "no send failed while etcd was down"
        assert all(f.retriable and f.code == ErrorCode.NOT_LEADER for f in down_failures), [
            (f.code, f.message) for f in down_failures]
        # the answer says why: the broker has no etcd session it can count on
        assert any("no valid etcd session" in f.message for f in down_failures), [
            f.message for f in down_failures]
        await _final_check(nodes, history)

    try:
        asyncio.run(go())
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
            await _final_check(nodes, history)
        finally:
            await history.finish()
            for n in nodes:
                n.kill()
            for p in proxies:
                await p.close()

    asyncio.run(go())
