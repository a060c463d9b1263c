"""Failure scenarios of a broker group shared by the tests and the benchmarks: the final
history check, and etcd taken down under load for a given time."""

from __future__ import annotations

import asyncio
import time

from onceq.protocol.errors import ErrorCode
from tests.cluster import chaos
from tests.cluster.group import Etcd, Node, leader_of, status
from tests.cluster.history import History, check, read_back


async def final_check(nodes: list[Node], history: History) -> dict[str, int]:
    """Every acknowledged send read back once at its offset from the leader (once all
    replicas are in sync again), and the replicas' logs equal up to the high watermark.
    Returns the counts checked (acknowledged sends lost, stored twice, moved)."""
    leader = await leader_of(nodes, timeout=10, isr=len(nodes))
    problems = check(history, await read_back(leader.address))
    assert problems == {"lost": [], "stored_twice": [], "moved": []}, problems
    equal, hw = await chaos._replicas_equal(nodes, leader, 10)
    assert equal and hw > 0, "the replicas' logs differ below the high watermark"
    return {k: len(v) for k, v in problems.items()}


async def etcd_outage(etcd: Etcd, nodes: list[Node], seconds: float, ttl: float) -> dict:
    """etcd stopped (SIGSTOP) for ``seconds`` under load: the leader stops serving within
    ``ttl`` of the outage's start (TTL minus the margin after its last renewal), nobody
    leads while etcd is down, and sends fail retriable (NOT_LEADER, saying the broker has
    no valid etcd session); etcd back, a leader is elected and sends succeed again.
    Nothing acknowledged is lost or stored twice. Returns the figures."""
    await leader_of(nodes, isr=3)
    history = History().start(",".join(n.address for n in nodes), send_timeout=1.0)
    leaders_seen: list[tuple[float, str]] = []  # (when, broker) seen leading while down
    try:
        await history.wait_acked_after(0, 20, 10, "sends acknowledged")
        down = time.monotonic()
        etcd.pause()
        try:
            while time.monotonic() < down + seconds:
                for n in nodes:
                    st = await status(n)
                    if st is not None and st.get("role") == "leader":
                        leaders_seen.append((time.monotonic() - down, n.broker_id))
                await asyncio.sleep(0.1)  # a status sample every 0.1 s
        finally:
            etcd.resume()
        up = time.monotonic()
        await leader_of(nodes, timeout=10)
        led = time.monotonic()
        await history.wait_acked_after(up, 10, 10, "sends acknowledged after etcd is back")
        served = time.monotonic()
    finally:
        await history.finish()
    late_acks = [k for k, (_, _, acked) in history.acked.items() if down + ttl < acked < up]
    assert late_acks == [], "writes acknowledged after the lease could have expired"
    assert all(t < ttl for t, _ in leaders_seen), leaders_seen
    down_failures = [f for f in history.failures if down < f.at < up + 0.5]
    assert down_failures, "no send failed while etcd was down"
    assert all(f.retriable and f.code == ErrorCode.NOT_LEADER for f in down_failures), [
        (f.code, f.message) for f in down_failures]
    # the answer says why: the broker has no etcd session it can count on
    assert any("no valid etcd session" in f.message for f in down_failures), [
        f.message for f in down_failures]
    checked = await final_check(nodes, history)
    return {**checked, "outage_s": round(up - down, 2), "acknowledged": len(history.acked),
            "failed_attempts": len(history.failures),
            "leader_seen_until_s": round(max((t for t, _ in leaders_seen), default=0), 2),
            "acknowledged_during_outage": sum(1 for _, _, a in history.acked.values()
                                              if down < a < up),
            "leader_after_etcd_back_s": round(led - up, 2),
            "sends_after_etcd_back_s": round(served - up, 2)}
