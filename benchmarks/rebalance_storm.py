"""Rebalance storm: duplicate deliveries caused by rebalances, access lock off vs on.

A topic of 16 queues; a producer at a steady rate; handlers taking a few milliseconds;
consumer processes joining and leaving on a fixed schedule (scale 1 -> 4 -> 2 -> 5 -> 1,
each leave a graceful shutdown), one consumer SIGKILLed once, and the broker SIGKILLed and
restarted once in the scale-4 phase (``--restart-at``: a quarter into it by default, where
no membership change is scheduled; the broker stays down ``--restart-down-s``, as a real
restart with recovery does, and one member, paused meanwhile, resumes ``--late-member-s``
after the broker is back, as a member on a slow host or in a pause would). Every delivery
is logged per consumer; afterwards deliveries are counted per unique key:

* lost: produced keys never delivered;
* duplicates: deliveries beyond the first, split into those caused by the consumer SIGKILL
  (the earlier delivery was by the killed consumer: its unacknowledged messages must be
  redelivered), those caused by the broker restart (the repeat came between the broker's
  kill and the end of its phase) and those caused by rebalances (all others);
* throughput: deliveries per second over the run, and the time to drain the backlog after
  the producer stops.

Both configurations run in the same invocation, each on a fresh broker. ``--groups N``
spreads the topic over N broker groups of one broker each (docs/cluster.md, "Consumer
groups across broker groups"): every consumer is a member on each group, and each group's
access lock guards its own queues.

``--trace`` turns the broker's delivery trace on for the group and runs the duplicate
audit (``onceq audit``, Spark) on it after the drain; the report then holds the audit's
counts next to the benchmark's, and a per-key cross-check: a handler can only see a message
as often as the broker delivered it, so handler deliveries beyond the traced ones
(``unexplained_by_trace``) must be 0. The audit counts more: it sees every delivery, also
those a consumer dropped before its handler ran (a queue taken away, a crash), and it
attributes a repeat to what happened since the previous delivery of the same stored
message, where this script attributes it by time (any repeat during the restart phase is
a broker-restart duplicate).
Usage: python benchmarks/rebalance_storm.py [--phase-s 6] [--rate 1000] [--handler-ms 2]
       [--flush sync] [--restart-phase 1] [--restart-at 0.25] [--restart-down-s 1]
       [--late-member-s 2] [--no-broker-restart] [--trace]
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _progress import Count, Steps, note  # noqa: E402
from throughput import start_broker  # noqa: E402

TOPIC = "storm"
GROUP = "storm-group"
SCHEDULE = [1, 4, 2, 5, 1]


def _restart_broker(proc: subprocess.Popen, data_dir: str, addr: str, flush: str,
                    down_s: float) -> tuple[subprocess.Popen, float]:
    """SIGKILL the broker, wait ``down_s``, start it again on the same port and data;
    (process, seconds from the new start until it accepted)."""
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(down_s)
    t0 = time.monotonic()
    port = addr.rsplit(":", 1)[1]
    err = open(os.path.join(data_dir, "broker-restart.err"), "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceq.cli.main", "broker", "start", "--data-dir", data_dir,
         "--port", port, "--flush", flush, "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=err)
    while proc.poll() is None and time.monotonic() - t0 < 30:
        try:
            with socket.create_connection(("127.0.0.1", int(port)), timeout=0.2):
                return proc, time.monotonic() - t0
        except OSError:
            time.sleep(0.02)
    err.seek(0)
    raise RuntimeError(f"broker did not restart: {err.read()[-2000:]}")


async def _produce(addr: str, rate: int, seconds: float, keys_out: list[str]) -> None:
    from onceq import OnceqError, Producer

    async with Producer(addr) as p:
        batch = max(rate // 100, 1)  # 100 sends a second
        t0 = time.monotonic()
        sent = 0
        while time.monotonic() - t0 < seconds:
            try:
                results = await p.send_batch(TOPIC, [b"x" * 100] * batch)
            except OnceqError:  # the broker is restarting: this batch is not counted
                await asyncio.sleep(0.1)
                continue
            keys_out.extend(r.unique_key for r in results)
            sent += batch
            ahead = sent / rate - (time.monotonic() - t0)
            if ahead > 0:
                await asyncio.sleep(ahead)


def _spawn(addr: str, name: str, out: str, lock: bool, handler_ms: float
           ) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "storm_consumer.py"), addr, GROUP, TOPIC, name,
         out, "1" if lock else "0", str(handler_ms)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    proc.stdout.readline()  # "ready"
    return proc


def _audit(addr: str) -> tuple[dict, dict[str, int]]:
    """The duplicate audit of GROUP from the broker's trace: (totals, deliveries per key)."""
    from onceq.spark.audit import audit_session, run_audit

    spark, _ = audit_session()  # kept for the second configuration
    report = run_audit(spark, addr, groups=[GROUP], window="10 minutes")
    per_key = {r["unique_key"]: r["n"] for r in report.deliveries.groupBy("unique_key")
               .count().withColumnRenamed("count", "n").collect()}
    [totals] = report.groups or [{}]
    return totals, per_key


class _Cluster:
    """Broker groups of one broker each and their etcd, stopped as one."""

    def __init__(self, etcd: Any, nodes: list[Any]) -> None:
        self.etcd, self.nodes = etcd, nodes

    def terminate(self) -> None:
        for n in self.nodes:
            n.kill()
        self.etcd.stop()

    def wait(self, _timeout: float) -> None:
        pass


async def _start_groups(root: Path, n: int) -> tuple[_Cluster, str]:
    """``n`` broker groups (g1..gn, one broker each) on a fresh etcd; the bootstrap list."""
    sys.path.insert(0, os.path.dirname(HERE))
    from tests.cluster.group import Etcd, leader_of, make_group

    binary = shutil.which("etcd")
    if binary is None:
        raise SystemExit("--groups needs etcd on the PATH (bash scripts/etcd.sh)")
    (root / "etcd").mkdir()
    etcd = Etcd(binary, root / "etcd")
    etcd.start()
    groups = {f"g{i}": make_group(root / f"g{i}", etcd.endpoint, "storm", 1,
                                  "--min-insync", "1", group=f"g{i}")
              for i in range(1, n + 1)}
    nodes = [x for ns in groups.values() for x in ns]
    for ns in groups.values():
        await leader_of(ns, timeout=40)
    return _Cluster(etcd, nodes), ",".join(x.address for x in nodes)


async def run_config(lock: bool, phase_s: float, rate: int, handler_ms: float,
                     drain_timeout: float, flush: str, restart_phase: int | None,
                     restart_at: float, restart_down_s: float, late_s: float,
                     trace: bool = False, groups: int = 0) -> dict:
    from onceq import Admin

    with tempfile.TemporaryDirectory(prefix="onceq-storm-") as d:
        data_dir = os.path.join(d, "data")
        if groups:  # a topic spread over broker groups of one broker each
            broker, addr = await _start_groups(Path(d), groups)
            restart_phase = None
        else:
            broker, addr = start_broker(data_dir, flush)
        restart_window = (float("inf"), float("inf"))  # wall times of kill and phase end
        restart_s = None
        procs: dict[str, subprocess.Popen] = {}
        files: dict[str, str] = {}
        try:
            async with Admin(addr) as admin:
                await admin.create_topic(TOPIC, 16)
                if trace:
                    await admin.group_trace(GROUP, True)
            keys: list[str] = []
            t0 = time.monotonic()
            t0_wall = time.time()
            prod = asyncio.create_task(_produce(addr, rate, phase_s * len(SCHEDULE), keys))
            serial = 0
            killed = None
            for i, target in enumerate(SCHEDULE):
                note(f"  phase {i + 1}/{len(SCHEDULE)}: {target} member(s), "
                     f"{len(keys)} produced so far")
                while len(procs) < target:
                    serial += 1
                    name = f"c{serial}"
                    files[name] = os.path.join(d, f"{name}.log")
                    procs[name] = await asyncio.to_thread(_spawn, addr, name, files[name], lock,
                                                          handler_ms)
                while len(procs) > target:
                    name = next(iter(procs))
                    p = procs.pop(name)
                    p.terminate()
                    await asyncio.to_thread(p.wait, 60)
                if i == 3:  # at scale 5, SIGKILL one member mid-phase
                    await asyncio.sleep(phase_s / 2)
                    killed = list(procs)[-1]
                    note(f"  SIGKILL member {killed}")
                    procs.pop(killed).send_signal(signal.SIGKILL)
                    serial += 1
                    name = f"c{serial}"
                    files[name] = os.path.join(d, f"{name}.log")
                    procs[name] = await asyncio.to_thread(_spawn, addr, name, files[name], lock,
                                                          handler_ms)
                    await asyncio.sleep(phase_s / 2)
                elif i == restart_phase:  # broker SIGKILL + restart
                    await asyncio.sleep(phase_s * restart_at)
                    late = procs[list(procs)[-1]] if late_s > 0 else None
                    if late is not None:  # one member comes back late (a pause, a slow host)
                        late.send_signal(signal.SIGSTOP)
                    t_kill = time.time()
                    note("  SIGKILL broker and restart")
                    broker, restart_s = await asyncio.to_thread(
                        _restart_broker, broker, data_dir, addr, flush, restart_down_s)
                    if late is not None:
                        await asyncio.sleep(late_s)
                        late.send_signal(signal.SIGCONT)
                    await asyncio.sleep(max(phase_s * (1 - restart_at)
                                            - (time.time() - t_kill), 1.0))
                    restart_window = (t_kill, time.time())
                else:
                    await asyncio.sleep(phase_s)
            await prod
            t_prod = time.monotonic()
            produced = set(keys)
            note(f"  {len(produced)} produced; waiting for the group to drain")
            deadline = time.monotonic() + drain_timeout
            drained = Count("delivered at least once", len(produced))
            while time.monotonic() < deadline:
                seen = set()
                for f in files.values():
                    with open(f) as fh:
                        seen.update(line.split(" ", 1)[0] for line in fh)
                drained.add(len(produced & seen) - drained.n)
                if produced <= seen:
                    drained.done()
                    break
                await asyncio.sleep(0.2)
            t_drained = time.monotonic()
            audit = None
            if trace:
                print(f"lock={lock}: running the duplicate audit (Spark)", file=sys.stderr)
                audit = await asyncio.to_thread(_audit, addr)
        finally:
            for p in procs.values():
                p.terminate()
            for p in procs.values():
                p.wait(60)
            broker.terminate()
            broker.wait(60)
        stats: collections.Counter[str] = collections.Counter()
        for f in files.values():
            if os.path.exists(f + ".stats"):
                with open(f + ".stats") as fh:
                    stats.update(json.load(fh))
        deliveries: dict[str, list[tuple[float, str, str]]] = collections.defaultdict(list)
        total = 0
        for name, f in files.items():
            with open(f) as fh:
                for line in fh:
                    key, ts, where = line.split()
                    deliveries[key].append((float(ts), name, where))
                    total += 1
    dup_crash = dup_rebalance = dup_restart = 0
    examples = []
    restart_examples = []
    for who in deliveries.values():
        who.sort()
        for i in range(1, len(who)):
            if any(w[1] == killed for w in who[:i]):
                dup_crash += 1
            elif restart_window[0] <= who[i][0] < restart_window[1]:
                dup_restart += 1
                if len(restart_examples) < 5:
                    restart_examples.append(
                        [f"{n}@{ts - t0_wall:.2f}s {w}" for ts, n, w in who])
            else:
                dup_rebalance += 1
                if len(examples) < 5:
                    examples.append([f"{n}@{ts - t0_wall:.2f}s {w}" for ts, n, w in who])
    lost = len(produced - set(deliveries))
    cross = None
    if audit is not None:
        totals, per_key = audit
        cross = {
            "audit": totals,
            "benchmark_duplicates": total - len(deliveries),
            "audit_duplicates": totals.get("duplicates"),
            "unexplained_by_trace": sum(max(0, len(w) - per_key.get(k, 0))
                                        for k, w in deliveries.items()),
            "keys_duplicated_in_handlers": sum(1 for w in deliveries.values() if len(w) > 1),
            "of_which_duplicated_in_trace": sum(1 for k, w in deliveries.items()
                                                if len(w) > 1 and per_key.get(k, 0) > 1),
        }
    return {
        "access_lock": lock,
        "produced": len(produced),
        "deliveries": total,
        "lost": lost,
        "duplicates_rebalance": dup_rebalance,
        "duplicates_crash": dup_crash,
        "duplicates_broker_restart": dup_restart,
        "broker_restart_s": None if restart_s is None else round(restart_s, 2),
        "consumer_stats": {k: stats[k] for k in ("offsets_resent", "locked")},
        "throughput_msg_s": round(total / max(t_drained - t0, 1e-9)),
        "drain_after_producer_s": round(t_drained - t_prod, 2),
        "consumers_started": serial,
        "killed": killed,
        "duplicate_examples": examples,
        "broker_restart_duplicate_examples": restart_examples,
        **({"trace_cross_check": cross} if cross is not None else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase-s", type=float, default=6.0)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--handler-ms", type=float, default=2.0)
    ap.add_argument("--drain-timeout", type=float, default=60.0)
    ap.add_argument("--flush", choices=["async", "sync"], default="sync")
    ap.add_argument("--restart-phase", type=int, default=1,
                    help="index in the schedule of the phase with the broker restart")
    ap.add_argument("--restart-at", type=float, default=0.25,
                    help="when in that phase, as a fraction of it (0.05: while the group "
                         "still settles after the phase's scale change)")
    ap.add_argument("--restart-down-s", type=float, default=1.0)
    ap.add_argument("--late-member-s", type=float, default=2.0,
                    help="one member is paused (SIGSTOP) during the restart and resumes "
                         "this long after the broker is back (0: none)")
    ap.add_argument("--no-broker-restart", dest="broker_restart", action="store_false")
    ap.add_argument("--trace", action="store_true",
                    help="trace deliveries and cross-check with the duplicate audit (Spark)")
    ap.add_argument("--groups", type=int, default=0,
                    help="spread the topic over this many broker groups of one broker each "
                         "(etcd on the PATH; no broker restart, no trace)")
    a = ap.parse_args()
    if a.groups:
        a.broker_restart = a.trace = False
    runs = {}
    steps = Steps(2)
    for lock in (False, True):
        steps.next(f"access lock {'on' if lock else 'off'}: {len(SCHEDULE)} phases of "
                   f"{a.phase_s}s at {a.rate} msg/s")
        runs["lock_on" if lock else "lock_off"] = asyncio.run(
            run_config(lock, a.phase_s, a.rate, a.handler_ms, a.drain_timeout, a.flush,
                       a.restart_phase if a.broker_restart else None, a.restart_at,
                       a.restart_down_s, a.late_member_s, a.trace, a.groups))
    off, on = runs["lock_off"], runs["lock_on"]
    report = {
        "workload": {"queues": 16, "broker_groups": a.groups or None,
                     "schedule": SCHEDULE, "phase_s": a.phase_s,
                     "rate_msg_s": a.rate, "handler_ms": a.handler_ms, "sigkill": 1,
                     "flush": a.flush,
                     "broker_restart_phase": a.restart_phase if a.broker_restart else None,
                     "broker_restart_at": a.restart_at, "broker_down_s": a.restart_down_s,
                     "late_member_s": a.late_member_s},
        **runs,
        "goals": {
            "lost == 0 (both)": off["lost"] == 0 and on["lost"] == 0,
            "broker restart duplicates with the lock == 0": (
                on["duplicates_broker_restart"] == 0),
            "rebalance duplicates on <= 1% of off": (
                on["duplicates_rebalance"] <= 0.01 * off["duplicates_rebalance"]
                if off["duplicates_rebalance"] else on["duplicates_rebalance"] == 0),
            "throughput cost of the lock (1 - on/off)": round(
                1 - on["throughput_msg_s"] / off["throughput_msg_s"], 3),
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
