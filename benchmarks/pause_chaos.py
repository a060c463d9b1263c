"""Paused member: what a consumer stopped mid-handler for longer than its locks last costs.

A broker with short liveness settings (``--heartbeat-expiry``, ``--lock-hold``; the orderly
queue-lock expiry equals the heartbeat expiry, retry delays are a few seconds), a topic of 8
queues, a producer sending ``--orders`` orders at ``--rate`` (the order id is the body and
the business key), and three consumer processes (``pause_consumer.py``) in one CLUSTERING
group, heartbeating every second, each logging every delivery and handler call (order,
queue, offset, name, wall time).

The chaos: c2's handler of the first order past ``--pause-at`` (60% by default) works
``--hold-s``; ``--stop-after-s`` into it (while c2 goes on pulling: with one listener call
at a time its cache fills) the parent SIGSTOPs c2, keeps it stopped ``--pause-s`` (longer
than the heartbeat expiry and the lock hold, so the broker drops it and the others take its
queues), then SIGCONTs it; the rest of that handler runs then. After the producer ends and
the group has drained (every order delivered, no handler call running, nothing new for
``--quiet-s`` with the committed offsets at the queues' ends, or for three times as long), a
fourth consumer joins: a rebalance, where offsets that are still back show up as a burst of
redeliveries; then the group drains again and everything stops.

The group's committed offsets are sampled every ``--sample-s``: a committed offset that goes
DOWN is an offset rewind (``offset_rewinds``; ``rewound_by`` sums the drops; each event with
the time until the queue's offset was back, ``back_after_s``). Per run, from the logs:

* lost: orders produced and never delivered;
* duplicate_deliveries: deliveries beyond the first per order (by time: before the pause,
  from the pause to the final rebalance, after it);
* duplicate_effects: business effects beyond the first per order; without idempotency the
  effect is the handler call, with ``--idempotency sqlite`` (the consumers'
  ``idempotency="sqlite:///<tmp>/dedup.db"``) it is a row in a separate SQLite table
  effects(order_id), written by the handler behind the guard;
* inflight_at_pause: messages c2 held unacknowledged when stopped (cached or in a listener
  call, as c2 last reported), at least its handler calls started and not finished;
  at_risk_at_pause adds what it had finished beyond the group's offsets (not committed yet):
  all the pause can cause to be redelivered by the queues' next owners;
* deliveries_by_c2_after_continue: c2's deliveries after SIGCONT, and how many of those
  orders had been delivered before (c2_after_continue_already_delivered).

``--pause-s 0``: no pause (the baseline). ``--src DIR`` runs the broker and the consumers
with that source tree first on PYTHONPATH (the producer and the sampling use this one's).
Every wait is bounded; a run past a bound is reported with ``timed_out``, and every process
is stopped at the end of a run, whatever ended it.

Usage: python benchmarks/pause_chaos.py [--runs 1] [--orders 3000] [--rate 150]
       [--pause-s 12] [--pause-at 0.6] [--idempotency none|sqlite] [--src DIR] [--keep DIR]
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _progress import Count, Steps, note  # noqa: E402
from throughput import start_broker  # noqa: E402

TOPIC = "orders"
GROUP = "pause-group"
QUEUES = 8
MEMBERS = ("c1", "c2", "c3")
PAUSED = "c2"
LATE = "c4"  # joins after the drain: the final rebalance
DELAY_LEVELS = "1s 1s 1s 1s 2s 2s 2s 2s 5s 5s 5s 5s 10s 10s 10s 10s 10s 10s"


class PhaseTimeout(Exception):
    """A bounded wait of the run ran out."""


class LogTail:
    """The consumers' log lines, read incrementally (complete lines only)."""

    def __init__(self) -> None:
        self.files: dict[str, str] = {}
        self._pos: dict[str, int] = {}
        self.lines: list[tuple[str, int, str, str, float]] = []  # kind, order, where, who, t
        self.delivered: set[int] = set()
        self.running = 0  # handler calls started and not finished (B lines less E lines)

    def add(self, name: str, path: str) -> None:
        self.files[name] = path
        self._pos[name] = 0

    def poll(self) -> int:
        """Read what was appended; the number of new lines."""
        n = 0
        for name, path in self.files.items():
            if not os.path.exists(path):
                continue
            with open(path, "rb") as fh:
                fh.seek(self._pos[name])
                data = fh.read()
            end = data.rfind(b"\n") + 1
            self._pos[name] += end
            for raw in data[:end].decode().splitlines():
                parts = raw.split()
                if len(parts) != 5:
                    continue
                kind, order, where, who, t = parts
                self.lines.append((kind, int(order), where, who, float(t)))
                if kind == "D":
                    self.delivered.add(int(order))
                elif kind == "B":
                    self.running += 1
                elif kind == "E":
                    self.running -= 1
                n += 1
        return n


class OffsetSampler:
    """Samples the group's committed offset (and the end) of every queue of TOPIC."""

    def __init__(self, admin, t0_wall: float) -> None:
        self.admin = admin
        self.t0 = t0_wall
        self.committed: list[int] = [-1] * QUEUES
        self.ends: list[int] = [0] * QUEUES
        self.rewinds: list[dict] = []
        self.samples = 0
        self.last_change = time.monotonic()

    async def sample(self) -> None:
        from onceq import OnceqError

        for q in range(QUEUES):
            try:
                off = await self.admin.group_offset(GROUP, TOPIC, q)
                self.ends[q] = (await self.admin.queue_offsets(TOPIC, q))[1]
            except OnceqError:
                continue
            prev = self.committed[q]
            if off != prev:
                self.last_change = time.monotonic()
                now = round(time.time() - self.t0, 2)
                if prev >= 0 and off < prev:
                    self.rewinds.append({"t": now, "queue": q, "from": prev, "to": off,
                                         "back_after_s": None})
                    note(f"  committed offset of queue {q} went back {prev} -> {off}")
                for ev in self.rewinds:  # how long until the queue got back where it was
                    if ev["queue"] == q and ev["back_after_s"] is None and off >= ev["from"]:
                        ev["back_after_s"] = round(now - ev["t"], 2)
                self.committed[q] = off
        self.samples += 1

    async def run(self, every: float) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(every)

    def at_end(self) -> bool:
        return all(c >= e for c, e in zip(self.committed, self.ends, strict=True))

    def lag(self) -> int:
        return sum(max(e - max(c, 0), 0) for c, e in zip(self.committed, self.ends, strict=True))


class Run:
    """One run: its processes, files, timeline and the figures that come out of it."""

    def __init__(self, d: str, a: argparse.Namespace) -> None:
        self.d = d
        self.a = a
        self.procs: dict[str, subprocess.Popen] = {}
        self.broker: subprocess.Popen | None = None
        self.addr = ""
        self.logs = LogTail()
        self.produced: list[int] = []
        self.send_errors = 0
        self.marker = os.path.join(d, "pause.marker")
        self.effects_db = os.path.join(d, "effects.db") if a.idempotency == "sqlite" else ""
        self.t0_wall = time.time()
        self.t_stop: float | None = None
        self.t_cont: float | None = None
        self.t_final: float | None = None
        self.paused_in_handler = False
        self.pause_marker: dict = {}
        self.committed_at_pause: dict[str, int] = {}
        self.timed_out: str | None = None
        self.error: str | None = None
        self.phases: dict[str, float] = {}
        self.settled: dict[str, dict] = {}
        self.sampler: OffsetSampler | None = None

    # ------------------------------------------------------------ processes
    def spawn(self, name: str, pause_from: int = -1) -> None:
        out = os.path.join(self.d, f"{name}.log")
        args = [sys.executable, os.path.join(HERE, "pause_consumer.py"), self.addr, GROUP,
                TOPIC, name, out, "--handler-ms", str(self.a.handler_ms),
                "--pause-from", str(pause_from), "--marker", self.marker,
                "--hold-s", str(self.a.hold_s), "--concurrency", str(self.a.concurrency)]
        if self.a.idempotency == "sqlite":
            args += ["--idempotency", f"sqlite:///{os.path.join(self.d, 'dedup.db')}",
                     "--effects", self.effects_db]
        self.logs.add(name, out)
        self.procs[name] = subprocess.Popen(args, stdout=subprocess.DEVNULL)

    async def wait_ready(self, names, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for name in names:
            path = self.logs.files[name] + ".ready"
            while not os.path.exists(path):
                if self.procs[name].poll() is not None:
                    raise RuntimeError(f"consumer {name} exited with "
                                       f"{self.procs[name].returncode}")
                if time.monotonic() > deadline:
                    raise PhaseTimeout(f"consumer {name} not ready after {timeout}s")
                await asyncio.sleep(0.05)

    def stop_consumers(self) -> None:
        """SIGTERM the consumers (a graceful shutdown), SIGKILL those still up after 20 s."""
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
                    p.terminate()
        deadline = time.monotonic() + 20
        for p in self.procs.values():
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_broker(self) -> None:
        if self.broker is not None and self.broker.poll() is None:
            self.broker.terminate()
            try:
                self.broker.wait(20)
            except subprocess.TimeoutExpired:
                self.broker.kill()
                self.broker.wait()

    def kill_all(self) -> None:
        for p in [*self.procs.values(), *([self.broker] if self.broker else [])]:
            if p.poll() is None:
                p.kill()
                p.wait()

    # ------------------------------------------------------------ the scenario
    async def produce(self) -> None:
        from onceq import Message, OnceqError, Producer

        count = Count("produced", self.a.orders)
        async with Producer(self.addr) as p:
            t0 = time.monotonic()
            i = 0
            failing = 0.0  # since when sends fail (0: they do not)
            while i < self.a.orders:
                try:
                    await p.send(TOPIC, Message(str(i).encode(), keys=f"order-{i}"))
                except OnceqError as exc:
                    self.send_errors += 1
                    failing = failing or time.monotonic()
                    if time.monotonic() - failing > 15:
                        raise RuntimeError(f"producer: sends fail for 15 s ({exc})") from exc
                    await asyncio.sleep(0.1)
                    continue  # the same order again
                failing = 0.0
                self.produced.append(i)
                count.add()
                i += 1
                ahead = i / self.a.rate - (time.monotonic() - t0)
                if ahead > 0:
                    await asyncio.sleep(ahead)
        self.phases["produce_end"] = time.time()
        count.done()

    async def chaos(self, admin) -> None:
        """SIGSTOP c2 inside its handler (on its marker), keep it stopped, SIGCONT it."""
        from onceq import OnceqError

        c2 = self.procs[PAUSED]
        deadline = time.monotonic() + self.a.orders / self.a.rate + 20
        while not os.path.exists(self.marker):
            if time.monotonic() > deadline:
                note(f"  no marker from {PAUSED}: stopping it outside a handler")
                break
            await asyncio.sleep(0.005)
        else:
            self.paused_in_handler = True
            # the paused handler holds the listener (and its queue's commit) while the
            # consumer goes on pulling: a cache builds up, as in a real stall before a pause
            await asyncio.sleep(self.a.stop_after_s)
        c2.send_signal(signal.SIGSTOP)
        self.t_stop = time.time()
        note(f"  SIGSTOP {PAUSED} ({len(self.produced)} produced) for {self.a.pause_s}s")
        # the group's offsets on c2's queues once its last commits are in: what it had
        # finished beyond them is redelivered by the queues' next owners
        await asyncio.sleep(min(0.3, self.a.pause_s))
        if self.paused_in_handler:  # c2's last marker: its state when it stopped
            with open(self.marker) as fh:
                self.pause_marker = json.load(fh)
        self.committed_at_pause = {}
        for key in self.pause_marker.get("commit_offsets", {}):
            topic, q = key.rsplit(":", 1)
            with contextlib.suppress(OnceqError):
                self.committed_at_pause[key] = await admin.group_offset(GROUP, topic, int(q))
        await asyncio.sleep(max(self.t_stop + self.a.pause_s - time.time(), 0))
        self.t_cont = time.time()  # before: c2 may log as soon as it runs again
        c2.send_signal(signal.SIGCONT)
        note(f"  SIGCONT {PAUSED} ({len(self.produced)} produced)")

    async def settle(self, label: str, timeout: float) -> None:
        """Wait until every produced order was delivered, no handler call is running and
        nothing (deliveries, committed offsets) changed for ``quiet_s``, with the committed
        offsets at the queues' ends (or, failing that, unchanged for three times as long)."""
        assert self.sampler is not None
        quiet = self.a.quiet_s
        t0 = time.monotonic()
        last_line = time.monotonic()
        want = set(self.produced)
        drained = Count(f"{label}: delivered at least once", len(want))
        while True:
            if self.logs.poll():
                last_line = time.monotonic()
            drained.add(len(want & self.logs.delivered) - drained.n)
            now = time.monotonic()
            still = now - max(last_line, self.sampler.last_change, t0)
            if want <= self.logs.delivered and self.logs.running <= 0 and (
                    still >= 3 * quiet or (still >= quiet and self.sampler.at_end())):
                break
            if now - t0 > timeout:
                raise PhaseTimeout(f"{label}: not drained after {timeout}s "
                                   f"({len(want - self.logs.delivered)} undelivered, "
                                   f"{self.logs.running} handler calls running, "
                                   f"lag {self.sampler.lag()})")
            await asyncio.sleep(0.1)
        drained.done()
        self.settled[label] = {"committed_at_end": self.sampler.at_end(),
                               "lag": self.sampler.lag(),
                               "seconds": round(time.monotonic() - t0, 2)}

    async def scenario(self) -> None:
        from onceq import Admin

        a = self.a
        async with Admin(self.addr) as admin:
            await admin.create_topic(TOPIC, QUEUES)
            if self.effects_db:
                with sqlite3.connect(self.effects_db) as db:
                    db.execute("PRAGMA journal_mode=WAL")
                    db.execute("CREATE TABLE effects(order_id INTEGER, consumer TEXT, t REAL)")
            pause_from = int(a.orders * a.pause_at) if a.pause_s > 0 else -1
            for name in MEMBERS:
                self.spawn(name, pause_from if name == PAUSED else -1)
            await self.wait_ready(MEMBERS, 30)
            # the group settled: every queue held (as far as the broker tells)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                members = await admin.group_members(GROUP)
                locks = await admin.access_locks(GROUP)
                holders = {r.get("holder") for r in locks if r.get("topic") == TOPIC}
                if len(members) == len(MEMBERS) and len(holders) == len(MEMBERS) and len(
                        [r for r in locks if r.get("topic") == TOPIC]) == QUEUES:
                    break
                await asyncio.sleep(0.2)
            else:
                note("  the group did not settle in 15s (going on)")
            self.sampler = OffsetSampler(admin, self.t0_wall)
            sampling = asyncio.create_task(self.sampler.run(a.sample_s))
            try:
                self.phases["produce_start"] = time.time()
                prod = asyncio.create_task(self.produce())
                chaos = asyncio.create_task(self.chaos(admin)) if a.pause_s > 0 else None
                try:
                    await prod
                    if chaos is not None:
                        await chaos
                finally:
                    for t in (prod, chaos):
                        if t is not None:
                            t.cancel()
                note(f"  {len(self.produced)} produced; waiting for the group to drain")
                await self.settle("drain", a.drain_timeout)
                note(f"  final rebalance: {LATE} joins")
                self.t_final = time.time()
                self.spawn(LATE)
                await self.wait_ready([LATE], 30)
                deadline = time.monotonic() + 15  # the rebalance: c4 holds queues
                while time.monotonic() < deadline:
                    if any(str(r.get("holder", "")).endswith(f"#{LATE}")
                           for r in await admin.access_locks(GROUP)):
                        self.phases["c4_holds"] = time.time()
                        break
                    await asyncio.sleep(0.1)
                else:
                    note(f"  {LATE} holds no queue after 15s (going on)")
                await self.settle("after_rebalance", a.drain_timeout)
            finally:
                sampling.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampling

    async def run(self) -> None:
        try:
            self.broker, self.addr = await asyncio.to_thread(
                start_broker, os.path.join(self.d, "data"), "async", [
                    "--heartbeat-expiry", str(self.a.heartbeat_expiry), "--expiry-check", "1",
                    "--access-lock-hold", str(self.a.lock_hold),
                    "--long-poll-max", str(min(2.0, self.a.lock_hold / 2)),
                    "--queue-lock-expiry", str(self.a.heartbeat_expiry),
                    "--delay-levels", DELAY_LEVELS])
            await asyncio.wait_for(self.scenario(), self.a.run_timeout)
        except (TimeoutError, PhaseTimeout) as exc:
            self.timed_out = str(exc) or f"run not done after {self.a.run_timeout}s"
            note(f"  TIMED OUT: {self.timed_out}")
        except Exception as exc:  # reported with the figures gathered so far
            last = (str(exc).strip().splitlines() or [""])[-1]  # a child's traceback: its end
            self.error = f"{type(exc).__name__}: {str(exc)[:80]}...{last[-200:]}"
            note(f"  FAILED: {self.error}")
        try:
            await asyncio.to_thread(self.stop_consumers)
            if self.sampler is not None and self.broker is not None and (
                    self.broker.poll() is None):  # a last sample, after the final commits
                from onceq import Admin, OnceqError

                try:
                    async with Admin(self.addr) as admin:
                        self.sampler.admin = admin
                        await asyncio.wait_for(self.sampler.sample(), 30)
                except (OnceqError, OSError, TimeoutError) as exc:
                    note(f"  no last offset sample: {exc}")
        finally:
            await asyncio.to_thread(self.stop_consumers)
            await asyncio.to_thread(self.stop_broker)

    # ------------------------------------------------------------ figures
    def report(self, seconds: float) -> dict:
        self.logs.poll()
        delivered: dict[int, list[tuple[float, str]]] = collections.defaultdict(list)
        handled: collections.Counter[int] = collections.Counter()
        c2_begun: collections.Counter[str] = collections.Counter()
        c2_ended: collections.Counter[str] = collections.Counter()
        for kind, order, where, who, t in self.logs.lines:
            if kind == "D":
                delivered[order].append((t, who))
            elif kind == "B":
                handled[order] += 1
            if who == PAUSED and self.t_stop is not None and t < self.t_stop:
                if kind == "B":
                    c2_begun[where] += 1
                elif kind == "E":
                    c2_ended[where] += 1
        if self.effects_db:
            with contextlib.closing(sqlite3.connect(self.effects_db, timeout=30)) as db:
                effects = collections.Counter(dict(db.execute(
                    "SELECT order_id, COUNT(*) FROM effects GROUP BY order_id")))
        else:
            effects = handled
        produced = set(self.produced)
        t_stop = self.t_stop if self.t_stop is not None else float("inf")
        t_final = self.t_final if self.t_final is not None else float("inf")
        by_phase = collections.Counter()
        after_cont = after_cont_dup = 0
        for who in delivered.values():
            who.sort()
            for i, (t, name) in enumerate(who):
                if i:
                    by_phase["before_pause" if t < t_stop else
                             "pause_to_final_rebalance" if t < t_final else
                             "after_final_rebalance"] += 1
                if name == PAUSED and self.t_cont is not None and t >= self.t_cont:
                    after_cont += 1
                    after_cont_dup += i > 0
        running = sum(max(n - c2_ended[k], 0) for k, n in c2_begun.items())
        held = self.pause_marker.get("held")
        done_uncommitted = None
        if self.committed_at_pause:
            done_uncommitted = sum(max(off - self.committed_at_pause.get(k, off), 0) for k, off
                                   in self.pause_marker["commit_offsets"].items())
        stats: dict[str, collections.Counter] = {}
        for name, path in self.logs.files.items():
            if os.path.exists(path + ".stats"):
                with open(path + ".stats") as fh:
                    stats[name] = collections.Counter(json.load(fh))
        total_stats: collections.Counter[str] = collections.Counter()
        for s in stats.values():
            total_stats.update(s)
        sampler = self.sampler
        rel = (lambda t: None if t is None else round(t - self.t0_wall, 2))  # noqa: E731
        return {
            "orders": len(produced),
            "lost": len(produced - set(delivered)),
            "orders_without_effect": len(produced - {o for o, n in effects.items() if n}),
            "deliveries": sum(len(w) for w in delivered.values()),
            "duplicate_deliveries": sum(len(w) - 1 for w in delivered.values()),
            "duplicate_deliveries_by_phase": {k: by_phase[k] for k in (
                "before_pause", "pause_to_final_rebalance", "after_final_rebalance")},
            "duplicate_handler_calls": sum(n - 1 for n in handled.values() if n > 1),
            "duplicate_effects": sum(n - 1 for n in effects.values() if n > 1),
            "inflight_at_pause": (None if self.t_stop is None
                                  else max(running, held or 0)),
            "c2_handlers_running_at_pause": None if self.t_stop is None else running,
            "c2_held_unacked_at_pause": held,
            "c2_done_uncommitted_at_pause": done_uncommitted,
            "at_risk_at_pause": None if held is None else held + (done_uncommitted or 0),
            "paused_in_handler": self.paused_in_handler,
            "deliveries_by_c2_after_continue": after_cont,
            "c2_after_continue_already_delivered": after_cont_dup,
            "offset_rewinds": len(sampler.rewinds) if sampler else 0,
            "rewound_by": sum(r["from"] - r["to"] for r in sampler.rewinds) if sampler else 0,
            "rewind_events": sampler.rewinds[:20] if sampler else [],
            "final_committed_lag": sampler.lag() if sampler else None,
            "offset_samples": sampler.samples if sampler else 0,
            "settled": self.settled,
            "timeline_s": {"sigstop": rel(self.t_stop), "sigcont": rel(self.t_cont),
                           "final_rebalance": rel(self.t_final),
                           "c4_holds_queues": rel(self.phases.get("c4_holds")),
                           "produce_end": rel(self.phases.get("produce_end"))},
            "c2_commit_offsets_at_pause": self.pause_marker.get("commit_offsets"),
            "group_offsets_at_pause": self.committed_at_pause or None,
            "consumer_stats": dict(sorted(total_stats.items())),
            "c2_stats": dict(sorted(stats.get(PAUSED, {}).items())),
            "send_errors": self.send_errors,
            "timed_out": self.timed_out,
            "error": self.error,
            "seconds": round(seconds, 1),
        }


async def run_once(a: argparse.Namespace, i: int) -> dict:
    with contextlib.ExitStack() as stack:
        if a.keep:
            d = os.path.join(os.path.abspath(a.keep), f"run{i + 1}")
            os.makedirs(d)
        else:
            d = stack.enter_context(tempfile.TemporaryDirectory(prefix="onceq-pause-"))
        r = Run(d, a)
        t0 = time.monotonic()
        try:
            await r.run()
        finally:
            r.kill_all()  # whatever happened (an error, Ctrl-C), nothing is left running
        return r.report(time.monotonic() - t0)


SUMMED = ("orders", "lost", "duplicate_deliveries", "duplicate_effects", "inflight_at_pause",
          "deliveries_by_c2_after_continue", "offset_rewinds", "rewound_by")


def summary(runs: list[dict]) -> dict:
    return {
        "runs": len(runs),
        "totals": {k: sum(r[k] or 0 for r in runs) for k in SUMMED},
        "max_per_run": {k: max((r[k] or 0 for r in runs), default=0) for k in SUMMED},
        "runs_with_rewinds": sum(1 for r in runs if r["offset_rewinds"]),
        "runs_with_duplicate_effects": sum(1 for r in runs if r["duplicate_effects"]),
        "runs_timed_out": sum(1 for r in runs if r["timed_out"]),
        "runs_failed": sum(1 for r in runs if r["error"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--orders", type=int, default=3000)
    ap.add_argument("--rate", type=float, default=150.0, help="orders per second")
    ap.add_argument("--heartbeat-expiry", type=float, default=6.0,
                    help="broker: a member without heartbeat this long is removed (s)")
    ap.add_argument("--lock-hold", type=float, default=4.0,
                    help="broker: an access-lock holder not seen this long is displaced (s)")
    ap.add_argument("--pause-s", type=float, default=None,
                    help="how long c2 stays stopped (default: the longer of the heartbeat "
                         "expiry and the lock hold, plus 6 s; 0: no pause)")
    ap.add_argument("--pause-at", type=float, default=0.6,
                    help="c2 stops on the first order it handles from this fraction on "
                         "(0.6: it continues after the producer has ended; 0.3: while "
                         "orders still come)")
    ap.add_argument("--hold-s", type=float, default=3.0,
                    help="c2's paused handler works this long (running time) after writing "
                         "its marker; what is left when it is stopped runs after SIGCONT")
    ap.add_argument("--stop-after-s", type=float, default=1.0,
                    help="c2 is stopped this long after its paused handler started")
    ap.add_argument("--handler-ms", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=1,
                    help="listener calls at once per consumer")
    ap.add_argument("--idempotency", choices=["none", "sqlite"], default="none")
    ap.add_argument("--sample-s", type=float, default=0.5,
                    help="how often the committed offsets are sampled")
    ap.add_argument("--quiet-s", type=float, default=2.0,
                    help="drained: nothing changed for this long")
    ap.add_argument("--drain-timeout", type=float, default=60.0)
    ap.add_argument("--run-timeout", type=float, default=180.0)
    ap.add_argument("--keep", default=None, metavar="DIR",
                    help="keep each run's logs, marker and databases in DIR/runN")
    ap.add_argument("--src", default=None,
                    help="source tree for the broker and the consumers (first on PYTHONPATH)")
    a = ap.parse_args()
    if a.pause_s is None:
        a.pause_s = max(a.heartbeat_expiry, a.lock_hold) + 6.0
    if a.src:
        src = os.path.abspath(a.src)
        if not os.path.isdir(os.path.join(src, "onceq")):
            ap.error(f"{src} holds no onceq package")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (src, os.environ.get("PYTHONPATH")) if p)
    runs = []
    steps = Steps(a.runs)
    interrupted = False
    for i in range(a.runs):
        steps.next(f"run {i + 1}/{a.runs}: {a.orders} orders at {a.rate}/s, pause "
                   f"{a.pause_s}s, idempotency {a.idempotency}")
        try:
            runs.append(asyncio.run(run_once(a, i)))
        except KeyboardInterrupt:  # its processes are stopped; report the runs done
            note("interrupted")
            interrupted = True
            break
        r = runs[-1]
        note(f"  lost {r['lost']}, duplicate deliveries {r['duplicate_deliveries']}, "
             f"duplicate effects {r['duplicate_effects']}, rewinds {r['offset_rewinds']} "
             f"(by {r['rewound_by']}), {r['seconds']}s")
    report = {
        "workload": {"queues": QUEUES, "members": list(MEMBERS), "paused": PAUSED,
                     "orders": a.orders, "rate": a.rate, "pause_s": a.pause_s,
                     "pause_at": a.pause_at, "handler_ms": a.handler_ms,
                     "heartbeat_expiry_s": a.heartbeat_expiry, "lock_hold_s": a.lock_hold,
                     "idempotency": a.idempotency, "src": a.src},
        "runs": runs,
        **({"summary": summary(runs)} if len(runs) > 1 else {}),
        **({"interrupted": True} if interrupted else {}),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
