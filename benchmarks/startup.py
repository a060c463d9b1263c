"""Broker start-up time (open to serving) against the amount of data kept.

For each size (default 1 GiB and 4 GiB) a data directory is filled through the real store
API (``MessageStore.put``, batches of 256 messages of 2 KiB on 8 queues, async flush, default
1 GiB segments; the store clock is set one hour back so the data is older than the dedup
window). Then ``onceq broker start`` is spawned on it and timed from spawn until it accepts
a connection and answers a ping:

* ``clean``: after a clean shutdown (the checkpoint is at the log end);
* ``crash``: after a crash that left ``--tail-mib`` of log after the last checkpoint;
* ``powercut``: after a power cut: a broker of that tree runs in a child process on the
  data, on the test suite's power-cut model (``tests/powercut.py``), while three producers
  send messages of 1 KiB as fast as they are answered for 1.5-3 s (``benchmarks/
  powercut.py``; ``powercut_log_gib`` is the log size then); the power goes (what was
  not fsynced then is gone), the broker is killed, and the next start is timed; with the
  records its recovery scanned and whether it rebuilt every index from the whole log.

``--src`` runs another source tree (e.g. a ``git worktree`` of an older commit) for a
before/after comparison; the same data directory is used for both trees.

Usage: python benchmarks/startup.py [--sizes-gib 1 4] [--tail-mib 64] [--src DIR ...]
       [--no-powercut]
Prints one JSON document. Needs about the largest size free in the data directory's file
system; the data is deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SRC = os.path.join(ROOT, "src")
sys.path.insert(0, HERE)

from _progress import Steps, note  # noqa: E402

BODY = 2048
BATCH = 256
QUEUES = 8
TOPIC = "bench"

_BUILD = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
from onceq.log.record import encode_part
from onceq.storage.config import StoreConfig
from onceq.storage.store import MessageStore
data_dir, total, tail = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
clock = lambda: time.time() - 3600  # older than the dedup window
store = MessageStore(StoreConfig(data_dir), clock=clock)
store.open()
if store.log.end:  # data kept: append an unchecked tail to it
    total = max(total, store.log.end + tail)
if "bench" not in store.topics:
    store.create_topic("bench", 8)
body = os.urandom(2048)
n = 0
checkpointed = False
sys.path.insert(0, sys.argv[5])
from _progress import Count
count = Count("bytes written", total)
while store.log.end < total:
    if not checkpointed and store.log.end >= total - tail:
        store.write_checkpoint()
        checkpointed = True
    parts = [encode_part(body, "U%012d" % (n + i), 1) for i in range(256)]
    store.put("bench", n // 256 % 8, parts)
    n += 256
    count.add(store.log.end - count.n)
count.done()
# a crash: no final checkpoint (the page cache keeps the writes)
store.log.close()
for cq in store.queues.values():
    cq.close()
print(n)
"""


# a broker of the tree first on sys.path under load on the data, then a power cut
_POWERCUT = r"""
import asyncio, json, random, sys
sys.path[:0] = sys.argv[1:4]  # the tree, the repository (tests/), benchmarks/
from powercut import load_and_cut
from onceq.storage.config import StoreConfig
acked, _cut = asyncio.run(load_and_cut(sys.argv[4], StoreConfig(sys.argv[4]),
                                       random.Random(int(sys.argv[5])), topic="cut",
                                       seconds=(1.5, 3)))
print(json.dumps({"acked": sum(len(a) for a in acked.values())}))
"""


def power_cut(src: str, data_dir: str, seed: int) -> int:
    """Load the broker of ``src`` on ``data_dir`` and cut the power; messages acked."""
    out = subprocess.run([sys.executable, "-c", _POWERCUT, src, ROOT, HERE, data_dir,
                          str(seed)], check=True, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": src})
    return json.loads(out.stdout.strip().splitlines()[-1])["acked"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _ping(port: int) -> None:
    sys.path.insert(0, SRC)
    from onceq.client.admin import Admin

    async with Admin(f"127.0.0.1:{port}") as admin:
        await admin.ping()


def time_start(src: str, data_dir: str, log: list[str] | None = None) -> float:
    """Seconds from spawning a broker on ``data_dir`` until it answers a ping; stops it.
    ``log``: receives the broker's log lines (INFO and above) of the whole run."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": src}
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "onceq.cli.main", "broker", "start", "--data-dir",
             data_dir, "--port", str(port), "--log-level",
             "WARNING" if log is None else "INFO"],
            stdout=subprocess.DEVNULL, stderr=err, env=env,
        )
        try:
            while True:
                if proc.poll() is not None:
                    err.seek(0)
                    raise RuntimeError(err.read().decode()[-2000:])
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                        break
                except OSError:
                    time.sleep(0.01)
            asyncio.run(_ping(port))
            return time.perf_counter() - t0
        finally:
            proc.terminate()  # SIGTERM: a clean shutdown (writes the checkpoint)
            proc.wait(timeout=600)
            if log is not None:
                err.seek(0)
                log.extend(err.read().decode(errors="replace").splitlines())


def recovery_report(lines: list[str]) -> dict:
    """What a start's log says of its recovery: records scanned, and whether it rebuilt
    every index from the whole log."""
    scanned = None
    for line in lines:
        m = re.search(r"recovered (\d+) records from position (\d+)", line)
        if m and scanned is None:
            scanned = int(m.group(1))
    return {"scanned_records": scanned,
            "full_rebuild": any("rebuilding" in line for line in lines)}


def build(src: str, data_dir: str, size: int, tail: int) -> int:
    out = subprocess.run([sys.executable, "-c", _BUILD, src, data_dir, str(size), str(tail),
                          HERE], check=True, stdout=subprocess.PIPE, text=True)
    return int(out.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-gib", type=float, nargs="+", default=[1, 4])
    ap.add_argument("--tail-mib", type=int, default=64)
    ap.add_argument("--src", nargs="+", default=[SRC],
                    help="source trees to time (default: this one)")
    ap.add_argument("--dir", default=None, help="where to put the data (default: a temp dir)")
    ap.add_argument("--no-powercut", action="store_true",
                    help="skip the start after a power cut")
    args = ap.parse_args()
    results = []
    steps = Steps(len(args.sizes_gib) * (1 + len(args.src)))
    for gib in args.sizes_gib:
        size = int(gib * 1024 ** 3)
        tail = args.tail_mib * 1024 ** 2
        root = tempfile.mkdtemp(prefix="onceq-startup-", dir=args.dir)
        try:
            data = os.path.join(root, "data")
            steps.next(f"filling {gib} GiB of data ({args.tail_mib} MiB after the checkpoint)")
            t0 = time.perf_counter()
            messages = build(SRC, data, size, tail)
            build_s = time.perf_counter() - t0
            row = {"data_gib": gib, "messages": messages, "build_s": round(build_s, 1),
                   "unchecked_tail_mib": args.tail_mib, "trees": {}}
            for src in args.src:
                steps.next(f"timing broker starts on {gib} GiB, tree {src}")
                # the first start follows the crash; it checkpoints, so the second is clean
                crash_s = time_start(src, data)
                clean_s = time_start(src, data)
                note(f"  start after a crash {crash_s:.2f}s, after a clean stop {clean_s:.2f}s")
                row["trees"][src] = {"crash_start_s": round(crash_s, 3),
                                     "clean_start_s": round(clean_s, 3)}
                if not args.no_powercut:
                    note("  load, then a power cut")
                    acked = power_cut(src, data, seed=int(gib * 1000))
                    log_dir = os.path.join(data, "commitlog")
                    log_gib = sum(os.path.getsize(os.path.join(log_dir, n))
                                  for n in os.listdir(log_dir)) / 1024 ** 3
                    lines: list[str] = []
                    cut_s = time_start(src, data, lines)
                    rec = recovery_report(lines)
                    note(f"  start after a power cut {cut_s:.2f}s ({acked} messages sent "
                         f"under load, {rec['scanned_records']} records scanned, full "
                         f"rebuild: {rec['full_rebuild']})")
                    row["trees"][src].update({
                        "powercut_start_s": round(cut_s, 3), "powercut_acked": acked,
                        "powercut_log_gib": round(log_gib, 2),
                        "powercut_scanned_records": rec["scanned_records"],
                        "powercut_full_rebuild": rec["full_rebuild"]})
                # the next tree finds a crashed store again
                note("  appending an unchecked tail again")
                build(SRC, data, size + tail, tail)
            results.append(row)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"benchmark": "startup", "body_bytes": BODY, "batch": BATCH,
                      "queues": QUEUES, "results": results}, indent=1))


if __name__ == "__main__":
    main()
