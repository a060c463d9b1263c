"""Push-consumer throughput by listener kind and listener batch, for one or more source trees.

A broker in its own process (async flush), a topic of 8 queues with N messages of 100 bytes
(produced once), drained again and again by one push consumer process (pull batch 32, a
no-op listener, default concurrency) under a new consumer group each time: an ``async``
listener and a ``plain`` one (a function, run on the consumer's threads), at listener batch
1 (the default) and 32. Throughput is N / (time from the first message handled to the
last), as in consume.py.

``--src`` takes several source trees (e.g. ``git archive main src`` unpacked elsewhere, and
this one); each consumer runs with its tree first on PYTHONPATH. The trees take turns
within each round (and the order flips every round), so a noisy machine weighs on all of
them alike; figures are medians of --rounds runs, with each tree's ratio to the first.

Usage: python benchmarks/consume_batch.py [--n 100000] [--rounds 5] [--src DIR ...]
       [--configs async_batch1 async_batch32 plain_batch1 plain_batch32]
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
sys.path.insert(0, HERE)

from _progress import Steps, note  # noqa: E402
from consume import QUEUES, TOPIC, drain_rate, produce_backlog  # noqa: E402
from throughput import start_broker  # noqa: E402

CONFIGS = ("async_batch1", "async_batch32", "plain_batch1", "plain_batch32")


def run_once(addr: str, src: str, kind: str, batch: int, n: int, group: str, d: str) -> float:
    out = os.path.join(d, f"{group}.txt")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "consume_worker.py"), "push",
                          addr, TOPIC, str(QUEUES), out, group, str(batch), kind, group],
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        p.stdout.readline()
        return drain_rate([out], n, f"{kind} batch {batch}", 300)
    finally:
        p.terminate()
        p.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--src", nargs="+", default=[SRC],
                    help="source trees to compare (default: this one); ratios are to the first")
    a = ap.parse_args()
    srcs = [os.path.abspath(s) for s in a.src]
    rates: dict[str, dict[str, list[float]]] = {s: {} for s in srcs}
    configs = [(c.split("_")[0], int(c.split("batch")[1])) for c in a.configs]
    steps = Steps(a.rounds * len(configs) * len(srcs))
    with tempfile.TemporaryDirectory(prefix="onceq-consume-batch-") as d:
        broker, addr = start_broker(os.path.join(d, "data"), "async")
        try:
            note(f"producing {a.n} messages")
            produce_backlog(addr, a.n)
            for r in range(a.rounds):
                for kind, batch in configs:
                    for i, src in enumerate(srcs if r % 2 == 0 else srcs[::-1]):
                        steps.next(f"round {r + 1}/{a.rounds}: {kind} batch {batch}, {src}")
                        group = f"bench-{kind}-{batch}-{r}-{i}"
                        rate = run_once(addr, src, kind, batch, a.n, group, d)
                        rates[src].setdefault(f"{kind}_batch{batch}", []).append(rate)
        finally:
            broker.terminate()
            broker.wait(60)
    med = {s: {k: round(statistics.median(v)) for k, v in rs.items()}
           for s, rs in rates.items()}
    base = med[srcs[0]]
    report = {
        "workload": {"n": a.n, "queues": QUEUES, "body_bytes": 100, "pull_batch": 32,
                     "rounds": a.rounds},
        "msg_per_s_median": med,
        "runs": {s: {k: [round(x) for x in v] for k, v in rs.items()}
                 for s, rs in rates.items()},
        "ratio_to_first": {s: {k: round(v / base[k], 3) for k, v in m.items()}
                           for s, m in med.items() if s != srcs[0]},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
