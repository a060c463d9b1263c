"""CPU time of ``MessageStore.put`` with the dedup window on and steady.

Each source tree of ``--src`` (e.g. ``git archive main src`` unpacked elsewhere, and this
one) is measured in child processes, one after the other and ``--runs`` times over, for
each batch size of ``--batches``: a store with a 10 s window takes 16-byte messages with
unique producer-shaped keys (40 hex digits) on 8 queues, with a fake clock advancing so
that about 200,000 keys are in the window and expire as fast as they come. After
``--warmup`` messages, ``--n`` more are put and the process's CPU time spent in ``put``
is reported as microseconds per message (and messages/s). A tree that has record batches
stores a batch of more than one message the way a producer's ``send_batch`` reaches it, as
one record batch (``put_batch``; the producer's encoding is not timed); the others take
``put``. Prints one JSON document with
every run and the median per tree and batch size.

Usage: python benchmarks/dedup_put.py [--src DIR ...] [--batches 256 1] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
sys.path.insert(0, HERE)

from _progress import Steps, note  # noqa: E402

_PUT = r"""
import json, shutil, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
from onceq.log.record import encode_part
from onceq.storage.config import StoreConfig
from onceq.storage.store import MessageStore
try:  # a tree with record batches stores a producer's batch as one record
    from onceq.log.batch import encode_batch
except ImportError:
    encode_batch = None
batch, n, warmup = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
d = tempfile.mkdtemp(prefix="onceq-dedup-put-")
now = [1_700_000_000.0]
store = MessageStore(StoreConfig(d, dedup_window_s=10.0), clock=lambda: now[0])
store.open()
store.create_topic("bench", 8)
body = b"x" * 16
prefix = "0A00000100003039BEEF"
step = 10.0 / 200_000 * batch  # 200,000 keys per 10 s of store time
def run(total, base):
    spent = 0.0
    i = 0
    while i < total:
        parts = [encode_part(body, "%s%012X%08X" % (prefix, 1700000000000 + (base + i) // 1000,
                                                    base + i + j), 1) for j in range(batch)]
        if encode_batch is not None and batch > 1:
            payload = encode_batch(parts)  # the producer's work, not timed
            c = time.process_time()
            store.put_batch("bench", i // batch % 8, payload)
        else:
            c = time.process_time()
            store.put("bench", i // batch % 8, parts)
        spent += time.process_time() - c
        i += batch
        now[0] += step
    return spent, i
run(warmup, 0)
spent, done = run(n, 10_000_000)
print(json.dumps({"path": "record batch" if encode_batch and batch > 1 else "parts",
                  "us_per_msg": round(spent / done * 1e6, 3),
                  "msgs_per_s": round(done / spent), "keys": len(store.dedup)}))
store.close()
shutil.rmtree(d)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", nargs="+", default=[SRC])
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 1])
    ap.add_argument("--n", type=int, default=200_000, help="messages measured (batches > 1)")
    ap.add_argument("--n-single", type=int, default=60_000, help="messages measured (batch 1)")
    ap.add_argument("--warmup", type=int, default=250_000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    runs: dict[str, dict[int, list[dict]]] = {s: {b: [] for b in args.batches} for s in args.src}
    steps = Steps(args.runs * len(args.batches) * len(args.src))
    for r in range(args.runs):  # interleaved: a noisy spell hits every tree alike
        for b in args.batches:
            for src in args.src:
                n = args.n if b > 1 else args.n_single
                steps.next(f"batch={b}: {args.warmup} warm-up + {n} measured puts, "
                           f"run {r + 1}/{args.runs}, tree {src}")
                out = subprocess.run([sys.executable, "-c", _PUT, src, str(b), str(n),
                                      str(args.warmup)], check=True, capture_output=True,
                                     text=True)
                runs[src][b].append(json.loads(out.stdout.strip().splitlines()[-1]))
                note(f"  {runs[src][b][-1]['us_per_msg']} us/message")
    report = {src: {str(b): {"median_us_per_msg": statistics.median(
        r["us_per_msg"] for r in rs), "median_msgs_per_s": statistics.median(
        r["msgs_per_s"] for r in rs), "runs": rs} for b, rs in per.items()}
        for src, per in runs.items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
