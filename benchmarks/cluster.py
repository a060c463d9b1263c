"""Throughput of a 3-broker group (acks=all, min_insync 2) against the standalone broker,
in the same run: produce (record batches of ``--batch`` messages, ``--producers`` at
once) and consume (a pull consumer reading every queue to its end), the followers' lag
while producing, and the failover time of one leader SIGKILL.

    python benchmarks/cluster.py [--messages 100000] [--batch 100] [--size 100]

Needs ``etcd`` on the PATH (``bash scripts/etcd.sh``); starts its own etcd and brokers on
loopback. Prints JSON. All brokers share this machine's cores (three brokers on two cores
here): the ratios say what replication costs on one machine, not across a network.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onceq.client.admin import Admin
from onceq.client.producer import Producer
from onceq.client.pull import PullConsumer
from onceq.protocol.codes import PullStatus
from tests.cluster.group import Node, leader_of, make_group, start_etcd, status
from tests.helpers import free_port

TOPIC = "bench"
QUEUES = 4


async def produce(address: str, messages: int, batch: int, size: int, producers: int,
                  watch: Node | None) -> dict[str, float]:
    body = b"x" * size
    per = messages // producers // batch
    max_lag = 0

    async def one(p: Producer, q: int) -> None:
        for _ in range(per):
            await p.send_batch(TOPIC, [body] * batch, queue=q % QUEUES)

    async def lags(done: asyncio.Event) -> None:
        nonlocal max_lag
        while not done.is_set() and watch is not None:
            st = await status(watch)
            if st and st.get("lag"):
                max_lag = max(max_lag, *st["lag"].values())
            await asyncio.sleep(0.1)

    done = asyncio.Event()
    clients = [await Producer(address, send_timeout=30.0).start() for _ in range(producers)]
    watcher = asyncio.create_task(lags(done))
    t0 = time.perf_counter()
    await asyncio.gather(*(one(p, i) for i, p in enumerate(clients)))
    took = time.perf_counter() - t0
    done.set()
    await watcher
    for p in clients:
        await p.close()
    sent = per * batch * producers
    return {"messages": sent, "seconds": round(took, 2), "msgs_per_s": round(sent / took),
            "max_follower_lag_bytes": max_lag}


async def consume(address: str) -> dict[str, float]:
    n = 0
    t0 = time.perf_counter()
    async with PullConsumer(address, "bench") as c:
        for q in range(QUEUES):
            offset = 0
            while True:
                r = await c.pull(TOPIC, q, offset, 1000)
                if r.status != PullStatus.FOUND:
                    break
                n += len(r.messages)
                offset = r.next_offset
    took = time.perf_counter() - t0
    return {"messages": n, "seconds": round(took, 2), "msgs_per_s": round(n / took)}


async def failover(nodes: list[Node]) -> float:
    """Seconds from a leader SIGKILL to the first acknowledged send."""
    leader = await leader_of(nodes, isr=len(nodes))
    bootstrap = ",".join(n.address for n in nodes)
    async with Producer(bootstrap, send_timeout=30.0) as p:
        await p.send(TOPIC, b"before")
        t0 = time.monotonic()
        leader.kill()
        await p.send(TOPIC, b"after")
        return round(time.monotonic() - t0, 3)


async def run_standalone(root: Path, args: argparse.Namespace) -> dict[str, object]:
    port = free_port()
    node = Node("s", port, root / "standalone", ["--auto-create-topics"])
    node.data.mkdir(parents=True)
    node.start()
    try:
        await _wait_up(node.address)
        async with Admin(node.address) as a:
            await a.create_topic(TOPIC, QUEUES)
        return {"produce": await produce(node.address, args.messages, args.batch, args.size,
                                         args.producers, None),
                "consume": await consume(node.address)}
    finally:
        node.kill()


async def run_group(root: Path, etcd: str, args: argparse.Namespace) -> dict[str, object]:
    nodes = make_group(root / "group", etcd, f"b{uuid.uuid4().hex[:8]}", 3,
                       "--replica-lag-max-ms", "10000", "--replica-ack-timeout-ms", "10000")
    try:
        leader = await leader_of(nodes, timeout=30, isr=3)
        bootstrap = ",".join(n.address for n in nodes)
        async with Admin(bootstrap) as a:
            await a.create_topic(TOPIC, QUEUES)
        out: dict[str, object] = {
            "produce": await produce(bootstrap, args.messages, args.batch, args.size,
                                     args.producers, leader),
            "consume": await consume(bootstrap)}
        out["failover_s"] = await failover(nodes)
        return out
    finally:
        for n in nodes:
            n.kill()


async def _wait_up(address: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            async with Admin(address) as a:
                await a.ping()
                return
        except Exception:
            await asyncio.sleep(0.1)
    raise RuntimeError(f"broker at {address} did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--producers", type=int, default=4)
    args = ap.parse_args()
    binary = shutil.which("etcd")
    if binary is None:
        print("etcd is not installed: bash scripts/etcd.sh", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="onceq-cluster-bench-") as tmp:
        root = Path(tmp)
        (root / "etcd").mkdir()
        standalone = asyncio.run(run_standalone(root, args))
        with start_etcd(binary, root / "etcd") as etcd:
            group = asyncio.run(run_group(root, etcd, args))
    ratio = {k: round(group[k]["msgs_per_s"] / standalone[k]["msgs_per_s"], 2)  # type: ignore[index]
             for k in ("produce", "consume")}
    print(json.dumps({
        "messages": args.messages, "batch": args.batch, "size": args.size,
        "producers": args.producers, "cpus": os.cpu_count(),
        "note": "3 brokers, etcd and the clients share this machine's cores",
        "standalone": standalone, "group_acks_all": group, "group_over_standalone": ratio,
        "etcd": subprocess.run([binary, "--version"], capture_output=True, text=True)
        .stdout.splitlines()[0]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
