"""Produce and consume throughput of one topic spread over 1, 2 and 3 broker groups (one
replica each, then three replicas each with acks=all), in the same run, with the ratios to
the 1-group case; and what the groups cost and share: each broker process's CPU time, the
etcd calls and keys per topic creation, the etcd calls a broker makes every second at rest
(the routes and the groups directory it reads, its session's renewals), the cost of
reading the route table as it grows, and the ``GET_ROUTE`` requests the clients made.

    python benchmarks/scale_out.py [--messages 120000] [--replicas 1,3] [--groups 1,2,3]

Needs ``etcd`` on the PATH (``bash scripts/etcd.sh``); starts its own etcd and brokers on
loopback (one etcd for the whole run, a cluster name per case). Prints JSON on stdout
(progress on stderr). Every message sent is read back once before any figure is printed.

All brokers, etcd and the clients share this machine's cores (up to nine brokers on two
cores here): more groups do not add CPU, so the ratios show what spreading a topic over
groups costs on one machine, not what it gains on several. docs/cluster.md, "Scale-out:
measured and modelled", turns the per-group cost measured here into a model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._progress import note
from onceq.client.admin import Admin
from onceq.client.connection import BrokerConnection, call
from onceq.client.producer import Producer
from onceq.client.pull import PullConsumer
from onceq.cluster import EtcdClient, place, read_routes
from onceq.cluster._etcd import put_op
from onceq.cluster._routes import TopicRoute, route_key
from onceq.protocol.codes import PullStatus
from onceq.protocol.replies import RouteInfo
from onceq.protocol.requests import GetRoute
from tests.cluster.group import Etcd, Node, leader_of, make_group
from tests.helpers import wait_until

TOPIC = "scale"
CLK = os.sysconf("SC_CLK_TCK")
IDLE_S = 4.0  # the window in which the brokers' calls to etcd at rest are counted
PROBE_TOPICS = 10  # topics created to count the etcd calls of one creation


# ---------------------------------------------------------------- measuring
def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / CLK


def etcd_counters(endpoint: str) -> Counter[str]:
    """etcd's own counters: gRPC calls handled per method (the JSON gateway's calls land
    there too), mvcc puts/txns/ranges, keys, bytes sent to clients."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("grpc_server_handled_total{"):
            method = re.search(r'grpc_method="([^"]+)"', line)
            if method:
                out[f"call_{method.group(1)}"] += int(float(line.rsplit(" ", 1)[1]))
        else:
            for name in ("etcd_mvcc_put_total", "etcd_mvcc_txn_total",
                         "etcd_mvcc_range_total", "etcd_debugging_mvcc_keys_total",
                         "etcd_network_client_grpc_sent_bytes_total"):
                if line.startswith(name + " "):
                    out[name] = int(float(line.rsplit(" ", 1)[1]))
    return out


def diff(after: Counter[str], before: Counter[str]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


class Cpu:
    """CPU seconds of the brokers (per group), etcd and this process over a phase."""

    def __init__(self, groups: dict[str, list[Node]], etcd: Etcd) -> None:
        self.groups, self.etcd = groups, etcd

    def snap(self) -> dict[str, float]:
        assert self.etcd.proc is not None
        out = {f"{g}/{n.broker_id}": cpu_s(n.proc.pid)  # type: ignore[union-attr]
               for g, ns in self.groups.items() for n in ns}
        out["etcd"] = cpu_s(self.etcd.proc.pid)
        out["client"] = time.process_time()
        return out

    def since(self, before: dict[str, float], leaders: dict[str, Node],
              messages: int) -> dict[str, object]:
        now = self.snap()
        d = {k: now[k] - before[k] for k in now}
        per_group = {g: round(sum(d[f"{g}/{n.broker_id}"] for n in ns), 3)
                     for g, ns in self.groups.items()}
        lead = {g: round(d[f"{g}/{n.broker_id}"], 3) for g, n in leaders.items()}
        brokers = sum(per_group.values())
        return {"brokers_s": round(brokers, 3), "per_group_s": per_group,
                "leaders_s": lead, "etcd_s": round(d["etcd"], 3),
                "client_s": round(d["client"], 3),
                "broker_us_per_msg": round(brokers / messages * 1e6, 2),
                "client_us_per_msg": round(d["client"] / messages * 1e6, 2)}


# ---------------------------------------------------------------- one case
def body_of(producer: int, batch: int, i: int, size: int) -> bytes:
    return f"{producer}:{batch}:{i}:".encode().ljust(size, b"x")


async def produce(bootstrap: str, args: argparse.Namespace) -> tuple[dict[str, float], int,
                                                                       dict[bytes, int]]:
    """``--producers`` at once, producer ``p`` sending batches to queue ``p % queues``."""
    per = args.messages // args.producers // args.batch
    sent: dict[bytes, int] = {}  # body -> the queue it was sent to
    plan = []
    for p in range(args.producers):
        batches = [[body_of(p, b, i, args.size) for i in range(args.batch)]
                   for b in range(per)]
        for batch in batches:
            for body in batch:
                sent[body] = p % args.queues
        plan.append(batches)
    clients = [await Producer(bootstrap, send_timeout=30.0).start()
               for _ in range(args.producers)]

    async def one(p: Producer, i: int) -> None:
        for batch in plan[i]:
            results = await p.send_batch(TOPIC, batch, queue=i % args.queues)
            assert len(results) == len(batch) and not any(r.duplicate for r in results)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p, i) for i, p in enumerate(clients)))
    took = time.perf_counter() - t0
    fetched = sum(p.links.fetched for p in clients)
    for p in clients:
        await p.close()
    n = len(sent)
    return {"messages": n, "seconds": round(took, 3), "msgs_per_s": round(n / took)}, \
        fetched, sent


async def consume(bootstrap: str, args: argparse.Namespace
                  ) -> tuple[dict[str, float], int, list[tuple[int, bytes]]]:
    """``--consumers`` pull consumers at once, consumer ``c`` reading every queue
    ``q % consumers == c`` to its end."""
    got: list[tuple[int, bytes]] = []
    consumers = [await PullConsumer(bootstrap, "scale").start()
                 for _ in range(args.consumers)]

    async def one(c: PullConsumer, i: int) -> None:
        for q in range(i, args.queues, args.consumers):
            offset = 0
            while (r := await c.pull(TOPIC, q, offset, 1000)).status == PullStatus.FOUND:
                got.extend((q, m.body) for m in r.messages)
                offset = r.next_offset

    t0 = time.perf_counter()
    await asyncio.gather(*(one(c, i) for i, c in enumerate(consumers)))
    took = time.perf_counter() - t0
    fetched = sum(c.links.fetched for c in consumers)
    for c in consumers:
        await c.close()
    return {"messages": len(got), "seconds": round(took, 3),
            "msgs_per_s": round(len(got) / took)}, fetched, got


async def get_route(address: str, topic: str) -> RouteInfo:
    conn = await BrokerConnection.open(address)
    try:
        return await call(conn, GetRoute(topic), 5.0)
    finally:
        conn.close()


async def topic_everywhere(leaders: dict[str, Node], nodes: list[Node], topic: str,
                           queues: int, placement: list[str] | None) -> None:
    """Every broker answers the route, every group's leader holds the topic."""
    for n in nodes:
        async def routed(n: Node = n) -> bool:
            r = await get_route(n.address, topic)
            return len(r.placement) == queues if placement is None \
                else list(r.placement) == placement
        await wait_until(routed, 15, f"the route of {topic} on {n.address}", interval=0.05)
    for leader in leaders.values():
        async def held(leader: Node = leader) -> bool:
            # LIST_TOPICS, not GET_TOPIC: with auto-create on, GET_TOPIC would create the
            # topic here with the default queue count before the route reached this group
            async with Admin(leader.address) as a:
                return any(t["topic"] == topic and t["queues"] == queues
                           for t in await a.list_topics())
        await wait_until(held, 15, f"{topic} on {leader.address}", interval=0.05)


async def run_case(root: Path, etcd: Etcd, groups_n: int, replicas: int,
                   args: argparse.Namespace) -> dict[str, object]:
    cluster = f"s{uuid.uuid4().hex[:8]}"
    names = [f"g{i}" for i in range(1, groups_n + 1)]
    extra = (["--min-insync", "1"] if replicas == 1 else
             ["--replica-lag-max-ms", "10000", "--replica-ack-timeout-ms", "10000"])
    groups = {g: make_group(root / cluster / g, etcd.endpoint, cluster, replicas, *extra,
                            group=g) for g in names}
    nodes = [n for ns in groups.values() for n in ns]
    cpu = Cpu(groups, etcd)
    try:
        leaders = {g: await leader_of(ns, timeout=40, isr=replicas)
                   for g, ns in groups.items()}
        bootstrap = ",".join(n.address for n in nodes)
        await asyncio.sleep(1.5)  # every broker has read the routes and the directory

        # at rest: the calls every broker makes to etcd, and its CPU
        c0, s0, t0 = etcd_counters(etcd.endpoint), cpu.snap(), time.monotonic()
        await asyncio.sleep(IDLE_S)
        idle_s = time.monotonic() - t0
        idle = diff(etcd_counters(etcd.endpoint), c0)
        s1 = cpu.snap()
        per_broker = {k.removeprefix("call_"): round(v / idle_s / len(nodes), 2)
                      for k, v in idle.items() if k.startswith("call_")}
        idle_cpu = {k: round((s1[k] - s0[k]) / idle_s * 100, 2) for k in s1
                    if k != "client"}

        # one topic creation: the etcd writes and reads, beyond the reads at rest
        placement = list(place(args.queues, names))
        c0, t0 = etcd_counters(etcd.endpoint), time.monotonic()
        async with Admin(bootstrap) as admin:
            await admin.create_topic(TOPIC, args.queues)
            for i in range(PROBE_TOPICS):
                await admin.create_topic(f"probe-{i}", args.queues)
            admin_fetched = admin.links.fetched
        for t in [TOPIC, *(f"probe-{i}" for i in range(PROBE_TOPICS))]:
            await topic_everywhere(leaders, nodes, t, args.queues,
                                   placement if t == TOPIC else None)
        spent = time.monotonic() - t0
        made = diff(etcd_counters(etcd.endpoint), c0)
        k = PROBE_TOPICS + 1
        reads_at_rest = idle.get("call_Range", 0) / idle_s * spent
        creation = {
            "writes": round((made.get("call_Txn", 0) + made.get("call_Put", 0)) / k, 2),
            "keys_added": round(made.get("etcd_debugging_mvcc_keys_total", 0) / k, 2),
            "reads_beyond_rest": round((made.get("call_Range", 0) - reads_at_rest) / k, 1)}

        note(f"  {groups_n} group(s) x {replicas}: produce")
        s0 = cpu.snap()
        produced, p_fetched, sent = await produce(bootstrap, args)
        produced["cpu"] = cpu.since(s0, leaders, produced["messages"])  # type: ignore[assignment]
        note(f"  {groups_n} group(s) x {replicas}: consume")
        s0 = cpu.snap()
        consumed, c_fetched, got = await consume(bootstrap, args)
        consumed["cpu"] = cpu.since(s0, leaders, consumed["messages"])  # type: ignore[assignment]

        # correct before any figure: every message sent read back once, from its queue
        bodies = Counter(b for _, b in got)
        twice = sum(1 for c in bodies.values() if c > 1)
        lost = sum(1 for b in sent if b not in bodies)
        misplaced = sum(1 for q, b in got if sent.get(b) != q)
        assert twice == 0 and lost == 0 and misplaced == 0 and len(got) == len(sent), \
            f"read twice {twice}, lost {lost}, on another queue {misplaced}, " \
            f"read {len(got)} of {len(sent)}"
        per_group = Counter(placement[q] for q, _ in got)
        expected = Counter(placement[q] for q in sent.values())
        assert per_group == expected, (per_group, expected)
        return {"groups": groups_n, "replicas": replicas, "brokers": len(nodes),
                "placement": placement, "messages_per_group": dict(sorted(per_group.items())),
                "produce": produced, "consume": consumed,
                "get_route_requests": {"producers": p_fetched, "consumers": c_fetched,
                                       "admin": admin_fetched},
                "etcd_calls_per_broker_per_s_at_rest": per_broker,
                "cpu_percent_at_rest": idle_cpu,
                "etcd_per_topic_creation": creation}
    finally:
        for n in nodes:
            n.kill()


# ---------------------------------------------------------------- the route table
async def route_table_cost(etcd: Etcd, topics: int, queues: int, groups: int,
                           reads: int) -> dict[str, object]:
    """``topics`` routes of ``queues`` queues over ``groups`` groups written to etcd (a
    scratch cluster name), then read whole ``reads`` times as every broker reads them each
    second: the cost per read in this process and in etcd."""
    client = EtcdClient(etcd.endpoint)
    cluster = f"table{uuid.uuid4().hex[:6]}"
    names = [f"g{i}" for i in range(1, groups + 1)]
    doc_bytes = 0
    for start in range(0, topics, 100):
        ops = []
        for t in range(start, min(start + 100, topics)):
            route = TopicRoute(f"topic-{t:06d}", place(queues, names))
            value = json.dumps(route.to_json()).encode()
            doc_bytes = len(value)
            ops.append(put_op(route_key(cluster, route.topic), value))
        await client.txn([], ops)
    assert etcd.proc is not None
    e0, c0, w0 = cpu_s(etcd.proc.pid), time.process_time(), time.perf_counter()
    b0 = etcd_counters(etcd.endpoint)["etcd_network_client_grpc_sent_bytes_total"]
    for _ in range(reads):
        assert len(await read_routes(client, cluster)) == topics
    wall = (time.perf_counter() - w0) / reads
    sent = (etcd_counters(etcd.endpoint)["etcd_network_client_grpc_sent_bytes_total"]
            - b0) / reads
    await client.delete(f"/onceq/{cluster}/".encode(), prefix=True)
    return {"topics": topics, "queues": queues, "groups": groups,
            "route_value_bytes": doc_bytes,
            "per_read": {"wall_ms": round(wall * 1e3, 2),
                         "broker_cpu_ms": round((time.process_time() - c0) / reads * 1e3, 2),
                         "etcd_cpu_ms": round((cpu_s(etcd.proc.pid) - e0) / reads * 1e3, 2),
                         "etcd_sent_bytes": round(sent)}}


# ---------------------------------------------------------------- main
def ratios(runs: dict[str, dict], replicas: int, groups: list[int]) -> dict[str, object]:
    base = runs.get(f"1x{replicas}")
    if base is None:
        return {}
    return {f"{g}_groups": {k: round(runs[f"{g}x{replicas}"][k]["msgs_per_s"]
                                     / base[k]["msgs_per_s"], 2)
                            for k in ("produce", "consume")}
            for g in groups if f"{g}x{replicas}" in runs}


async def run_all(root: Path, etcd: Etcd, args: argparse.Namespace) -> dict[str, object]:
    runs: dict[str, dict] = {}
    cases = [(g, r) for r in args.replicas for g in args.groups]
    for i, (g, r) in enumerate(cases, 1):
        note(f"({i}/{len(cases)}) {g} group(s) x {r} replica(s)")
        runs[f"{g}x{r}"] = await run_case(root, etcd, g, r, args)
    note("the route table: read cost as it grows")
    table = [await route_table_cost(etcd, t, args.queues, 3, 10)
             for t in args.route_tables]
    table += [await route_table_cost(etcd, 1000, q, 16, 10) for q in args.route_queues]
    return {"runs": runs, "route_table": table,
            "ratios_to_one_group": {f"replicas_{r}": ratios(runs, r, args.groups)
                                    for r in args.replicas}}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=120_000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--producers", type=int, default=6)
    ap.add_argument("--consumers", type=int, default=3)
    ap.add_argument("--queues", type=int, default=6, help="the topic's queues")
    ap.add_argument("--groups", type=ints, default=[1, 2, 3])
    ap.add_argument("--replicas", type=ints, default=[1, 3])
    ap.add_argument("--route-tables", type=ints, default=[1000, 10000],
                    help="route table sizes (topics of --queues queues over 3 groups) "
                         "whose read cost is measured")
    ap.add_argument("--route-queues", type=ints, default=[64, 256],
                    help="queue counts of 1,000 routes over 16 groups whose read cost is "
                         "measured too (a route grows with its queues)")
    args = ap.parse_args()
    if args.messages < args.producers * args.batch:
        ap.error("--messages must be at least --producers x --batch")
    binary = shutil.which("etcd")
    if binary is None:
        print("etcd is not installed: bash scripts/etcd.sh", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="onceq-scale-out-") as tmp:
        root = Path(tmp)
        (root / "etcd").mkdir()
        etcd = Etcd(binary, root / "etcd")
        etcd.start()
        try:
            out = asyncio.run(run_all(root, etcd, args))
        finally:
            etcd.stop()
    print(json.dumps({
        "messages": args.messages // args.producers // args.batch * args.producers
        * args.batch, "batch": args.batch, "size": args.size, "producers": args.producers,
        "consumers": args.consumers, "queues": args.queues, "cpus": os.cpu_count(),
        "note": "every broker, etcd and the clients share this machine's cores: the "
                "ratios show the overhead of more groups, not their gain",
        "session_ttl_s": 2, **out,
        "etcd": subprocess.run([binary, "--version"], capture_output=True, text=True)
        .stdout.splitlines()[0]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
