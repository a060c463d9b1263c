"""Power cuts under load: what a broker loses, and what its restart reads.

Each run starts a broker in this process on the power-cut model of the test suite
(``tests/powercut.py``, ``keep="size"``: a file keeps only what its last fsync covered),
with the default flush interval (500 ms) and checkpoint interval (1 s), 4 MiB segments
(bodies up to 64 KiB) and index files of 10,000 entries (so segments roll and index files
are created during the run).
Three producers send batches of 1-16 messages of 1 KiB to random queues of one topic of 4
queues, recording every acknowledged offset. After a random 2-5 s the power goes: the
disk keeps what was fsynced at that instant (the broker goes on for 0.3 s, writing what a
real cut would lose too), then the broker is killed and the files are cut back. A store is
opened on the directory, as the next start would, and every queue is read.

Per run: acknowledged before the cut, lost (acknowledged, not readable after), holes
(offsets missing, damaged or different below a queue's recovered end: a loss that is not
a clean suffix), whether the restart rebuilt every index from the whole log, the records
the restart scanned and its open time. For ``async`` the loss window is the age at the cut
of the oldest lost message (at most the flush interval plus an fsync).

``--src DIR ...`` runs each source tree in a child process (e.g. a ``git worktree`` of an
older commit) for a before/after comparison.

Usage: python benchmarks/powercut.py [--runs 20] [--modes sync async] [--src DIR ...]
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SRC = os.path.join(ROOT, "src")

BODY = 1024
QUEUES = 4
PRODUCERS = 3


class _Rebuilds(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.rebuilt = False
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.errors.append(msg)
        if "rebuilding" in msg:
            self.rebuilt = True


async def _kill(broker) -> None:
    """Stop the broker as a killed process would: no final flush, checkpoint, snapshot."""
    from tests.helpers import kill_store

    broker._closing = True
    if broker._server is not None:
        broker._server.close()
    tasks = [*broker._tasks, broker.flusher._task, broker.retry._task]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    pending = [*broker._io]
    if broker.flusher._inflight is not None:
        pending.append(broker.flusher._inflight)
    if pending:  # fsyncs started before the kill end in their threads
        await asyncio.wait(pending)
    for conn in list(broker.connections):
        conn.close()
    kill_store(broker.store)


def _store_config(root: str, flush: str):
    from onceq.storage.config import StoreConfig

    return StoreConfig(root, flush=flush, segment_size=4 * 1024 * 1024,
                       index_entries_per_file=10_000, max_body=64 * 1024)


async def load_and_cut(root: str, config, rng: random.Random, topic: str = "T",
                       seconds: tuple[float, float] = (2, 5), rate: float | None = None
                       ) -> tuple[dict, float]:
    """Run a broker on ``root`` under load (``rate``: messages per second at most, else as
    fast as answered), cut the power after a random time in ``seconds``, kill the broker
    and cut the files back. Returns the offsets acknowledged before the cut (queue ->
    offset -> (unique key, time)) and the time of the cut."""
    from onceq import Admin, Producer
    from onceq.broker.broker import Broker
    from onceq.broker.config import BrokerConfig
    from tests.powercut import PowerCutFiles

    files = PowerCutFiles(keep="size")
    broker = Broker(BrokerConfig(config, port=0), files=files)
    await broker.start()
    addr = f"127.0.0.1:{broker.port}"
    async with Admin(addr) as admin:
        await admin.create_topic(topic, QUEUES)
    acked: dict[int, dict[int, tuple[str, float]]] = {q: {} for q in range(QUEUES)}
    state = {"cut_at": None, "stop": False}

    async def produce() -> None:
        body = os.urandom(BODY)
        async with Producer(addr) as p:
            while not state["stop"]:
                q = rng.randrange(QUEUES)
                n = rng.randint(1, 16)
                try:
                    res = await p.send_batch(topic, [body] * n, queue=q)
                except Exception:  # the broker is gone
                    return
                if state["cut_at"] is None:  # answered before the power went
                    now = time.monotonic()
                    for r in res:
                        acked[r.queue_id][r.offset] = (r.unique_key, now)
                if rate:
                    await asyncio.sleep(n * PRODUCERS / rate)

    tasks = [asyncio.create_task(produce()) for _ in range(PRODUCERS)]
    await asyncio.sleep(rng.uniform(*seconds))
    files.cut_now()
    state["cut_at"] = time.monotonic()
    await asyncio.sleep(0.3)  # the broker goes on: what it writes now is lost
    state["stop"] = True
    await _kill(broker)
    await asyncio.gather(*tasks, return_exceptions=True)
    files.cut_power()
    return acked, state["cut_at"]


async def one_run(root: str, flush: str, rng: random.Random) -> dict:
    acked, cut_at = await load_and_cut(root, _store_config(root, flush), rng)
    return reopen(root, flush, acked, cut_at)


def reopen(root: str, flush: str, acked: dict, cut_at: float) -> dict:
    from onceq.log.record import decode_records
    from onceq.protocol.codes import PullStatus
    from onceq.storage.store import MessageStore

    handler = _Rebuilds()
    logging.getLogger("onceq").addHandler(handler)
    t0 = time.perf_counter()
    store = MessageStore(_store_config(root, flush))
    store.open()
    open_s = time.perf_counter() - t0
    logging.getLogger("onceq").removeHandler(handler)
    lost = holes = 0
    oldest_lost = 0.0
    for q in range(QUEUES):
        _lo, hi = store.min_max("T", q)
        found: dict[int, str] = {}
        off = 0
        while off < hi:
            r = store.get("T", q, off, 256, 8 << 20)
            if r.status == PullStatus.FOUND:
                for m in decode_records(r.payload, True, off, r.next_offset):
                    found[m.queue_offset] = m.unique_key
            off = max(r.next_offset, off + 1)
        # below the recovered end: nothing missing (damaged), nothing replaced
        holes += sum(1 for o in range(hi) if o not in found or (
            o in acked[q] and acked[q][o][0] != found[o]))
        for off, (key, at) in acked[q].items():
            if found.get(off) != key:
                lost += 1
                oldest_lost = max(oldest_lost, cut_at - at)
    store.close()
    return {"acked": sum(len(a) for a in acked.values()), "lost": lost, "holes": holes,
            "loss_window_ms": round(oldest_lost * 1000, 1), "full_rebuild": handler.rebuilt,
            "records_scanned": store.recovered_records, "open_s": round(open_s, 3),
            "errors_logged": handler.errors[:5]}


def summary(flush: str, runs: list[dict]) -> dict:
    return {
        "flush": flush, "runs": len(runs),
        "acked": sum(r["acked"] for r in runs),
        "lost": sum(r["lost"] for r in runs),
        "runs_with_loss": sum(1 for r in runs if r["lost"]),
        "holes": sum(r["holes"] for r in runs),
        "max_loss_window_ms": max(r["loss_window_ms"] for r in runs),
        "full_rebuilds": sum(1 for r in runs if r["full_rebuild"]),
        "records_scanned_median": statistics.median(r["records_scanned"] for r in runs),
        "acked_median": statistics.median(r["acked"] for r in runs),
        "open_s_median": statistics.median(r["open_s"] for r in runs),
        "per_run": runs,
    }


def worker(runs: int, modes: list[str], seed: int) -> dict:
    sys.path.insert(0, HERE)
    from _progress import note

    rng = random.Random(seed)
    out = []
    for flush in modes:
        results = []
        for i in range(runs):
            root = tempfile.mkdtemp(prefix="onceq-powercut-")
            try:
                r = asyncio.run(one_run(os.path.join(root, "data"), flush, rng))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            note(f"  {flush} run {i + 1}/{runs}: acked {r['acked']}, lost {r['lost']}, "
                 f"holes {r['holes']}, full rebuild {r['full_rebuild']}, "
                 f"scanned {r['records_scanned']}")
            results.append(r)
        out.append(summary(flush, results))
    return {"modes": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--modes", nargs="+", default=["sync", "async"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--src", nargs="+", default=[SRC], help="source trees to run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:  # in a child: this tree's onceq first on the path, then the tests
        print(json.dumps(worker(args.runs, args.modes, args.seed)))
        return
    sys.path.insert(0, HERE)
    from _progress import Steps

    steps = Steps(len(args.src))
    trees = {}
    for src in args.src:
        steps.next(f"{args.runs} power cuts per mode {args.modes}, tree {src}")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, ROOT])}
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--worker", "--runs", str(args.runs),
             "--seed", str(args.seed), "--modes", *args.modes],
            env=env, check=True, stdout=subprocess.PIPE, text=True)
        trees[src] = json.loads(out.stdout)["modes"]
    print(json.dumps({"benchmark": "powercut", "body_bytes": BODY, "queues": QUEUES,
                      "producers": PRODUCERS, "flush_interval_ms": 500,
                      "checkpoint_interval_ms": 1000, "trees": trees}, indent=1))


if __name__ == "__main__":
    main()
