"""Memory and restart cost of the broker's dedup window.

* ``rss``: a child process creates a ``DedupWindow`` (120 s, ``max_keys`` = N) and adds N
  unique keys shaped like the producer's (40 hex characters) on one topic, 8 queues; the
  growth of its resident set size (``/proc/self/statm``) is reported as MB per million
  keys, for each N of ``--keys`` (default 1 M and 2 M).
* ``rebuild``: a data directory is filled through ``MessageStore.put`` with
  ``--rebuild-keys`` (default 2 M) messages of 16 bytes with unique keys, batches of 256 on
  8 queues, all stored within the window (a fake clock: 2 M keys over 60 s), then closed
  cleanly. ``MessageStore.open()`` is timed (wall clock and the process's CPU time) in a
  fresh process, with the window (120 s, 2 M keys) and without it
  (``dedup_window_s=0``): the difference is the cost of rebuilding the window
  (``second_open``: the same store opened once more). A second pair of runs opens the
  store after a crash that left the last ``--tail-keys`` messages after the last
  checkpoint: the window comes from its journal up to that checkpoint and from the log
  after it (a tree without the journal reads the window's whole stretch of log). The put
  throughput of the fill (messages/s of CPU time, one
  process, dedup on) is reported too.

``--src`` takes several source trees (e.g. ``git archive main src`` unpacked elsewhere, and
this one) for a before/after comparison in one run. Prints one JSON document. The data
(~300 MB for 2 M keys) is deleted at the end.

Usage: python benchmarks/dedup_window.py [--keys 1000000 2000000] [--rebuild-keys 2000000]
       [--src DIR ...] [--skip-rss] [--skip-rebuild]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
sys.path.insert(0, HERE)

from _progress import Steps, note  # noqa: E402

_RSS = r"""
import gc, json, os, sys, time
sys.path.insert(0, sys.argv[1])
from onceq.storage.dedup import DedupWindow
n = int(sys.argv[2])
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
prefix = "0A00000100003039BEEF"
gc.collect()
before = rss()
w = DedupWindow(120.0, n)
ts = 1_700_000_000_000
t0 = time.process_time()
for i in range(n):
    key = b"%s%012X%08X" % (prefix.encode(), ts + i // 1000, i & 0xFFFFFFFF)
    w.add("bench", key, i % 8, i // 8, ts + i * 60_000 // n)
fill_s = time.process_time() - t0
gc.collect()
after = rss()
assert len(w) == n, len(w)
print(json.dumps({"keys": n, "rss_growth_mb": round((after - before) / 1e6, 1),
                  "mb_per_million_keys": round((after - before) / n, 1),
                  "add_us_per_key": round(fill_s / n * 1e6, 2)}))
"""

_BUILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from onceq.log.record import encode_part
from onceq.storage.config import StoreConfig
from onceq.storage.store import MessageStore
data_dir, total, tail = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
T0 = 1_700_000_000.0
now = [T0]
store = MessageStore(StoreConfig(data_dir), clock=lambda: now[0])
store.open()
store.create_topic("bench", 8)
body = b"x" * 16
prefix = "0A00000100003039BEEF"
step = 60.0 / total * 256  # all keys within 60 s of store time
n = 0
put_s = 0.0
while n < total:
    k = min(256, total - n)
    if tail and n <= total - tail < n + k:  # the last checkpoint before the crash
        store.write_checkpoint()
    parts = [encode_part(body, "%s%012X%08X" % (prefix, 1700000000000 + n // 1000, n + i), 1)
             for i in range(k)]
    t0 = time.process_time()
    res = store.put("bench", n // 256 % 8, parts)
    put_s += time.process_time() - t0
    assert not res.duplicates
    n += k
    now[0] += step
if tail:  # a crash: the tail after the checkpoint is not indexed durably
    store.log.sync()
    store.log.close()
    for cq in store.queues.values():
        cq.close()
else:
    store.close()
print(json.dumps({"end_s": now[0], "put_msgs_per_s": round(n / put_s)}))
"""

_OPEN = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from onceq.storage.config import StoreConfig
from onceq.storage.store import MessageStore
data_dir, now, window = sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
store = MessageStore(StoreConfig(data_dir, dedup_window_s=window), clock=lambda: now)
t0 = time.perf_counter()
c0 = time.process_time()
store.open()
dt = time.perf_counter() - t0
cpu = time.process_time() - c0
print(json.dumps({"open_s": round(dt, 3), "open_cpu_s": round(cpu, 3),
                  "keys": len(store.dedup)}))
"""


def child(what: str, script: str, *args: object) -> dict:
    note(f"  {what}")
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def rebuild(src: str, keys: int, tail: int, root: str) -> dict:
    res: dict = {"keys": keys}
    for name, t in (("clean", 0), ("crash", tail)):
        data = os.path.join(root, name)
        built = child(f"{name}: filling a store with {keys} keys", _BUILD, src, data, keys, t)
        now = built["end_s"] + 30
        with_w = child(f"{name}: open with the window", _OPEN, src, data, now, 120.0)
        # once more: the journal goes on across a start
        again = child(f"{name}: open again", _OPEN, src, data, now, 120.0) \
            if name == "clean" else None
        shutil.rmtree(data)
        # again: the first open checkpointed
        built2 = child(f"{name}: filling it again", _BUILD, src, data, keys, t)
        without = child(f"{name}: open without the window", _OPEN, src, data,
                        built2["end_s"] + 30, 0.0)
        shutil.rmtree(data)
        res[name] = {"open_s": with_w["open_s"], "open_cpu_s": with_w["open_cpu_s"],
                     "open_without_window_s": without["open_s"],
                     "open_without_window_cpu_s": without["open_cpu_s"],
                     "keys_rebuilt": with_w["keys"], "unchecked_tail_keys": t}
        if again is not None:
            res[name]["second_open_s"] = again["open_s"]
            res[name]["second_open_cpu_s"] = again["open_cpu_s"]
        res.setdefault("put_msgs_per_s", built["put_msgs_per_s"])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[1_000_000, 2_000_000])
    ap.add_argument("--rebuild-keys", type=int, default=2_000_000)
    ap.add_argument("--tail-keys", type=int, default=200_000)
    ap.add_argument("--src", nargs="+", default=[SRC],
                    help="source trees to measure, one after the other (default: this one)")
    ap.add_argument("--dir", default=None, help="where to put the data (default: a temp dir)")
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--skip-rebuild", action="store_true")
    args = ap.parse_args()
    out: dict = {}
    steps = Steps(len(args.src) * ((not args.skip_rss) + (not args.skip_rebuild)))
    for src in args.src:
        row: dict = {}
        out[src] = row
        if not args.skip_rss:
            steps.next(f"rss of the window, keys {args.keys}, tree {src}")
            row["rss"] = [child(f"rss: {n} keys", _RSS, src, n) for n in args.keys]
        if not args.skip_rebuild:
            steps.next(f"rebuild of the window at open, {args.rebuild_keys} keys, tree {src}")
            root = tempfile.mkdtemp(prefix="onceq-dedup-", dir=args.dir)
            try:
                row["rebuild"] = rebuild(src, args.rebuild_keys, args.tail_keys, root)
            finally:
                shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
