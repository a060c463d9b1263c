"""What the broker's metrics cost on the hot path: send and pull handlers, metrics off and on.

Two brokers in this process (async flush), one with ``metrics_port`` set; the SEND_BATCH
and PULL handlers are called directly (no network, so the handlers' own time is what is
compared, and the noise of sockets and other processes stays out): ``--batches`` batches
of ``--batch`` 100-byte messages with fresh unique keys are sent to one queue, then pulled
back ``--batch`` at a time. Rounds alternate off and on; each figure is the median over
``--rounds`` of microseconds per batch (after a warm-up round of both), and the ratio on/off
is the median of each round's ratio. On a busy machine that ratio is mostly noise, so the
hooks are also timed alone (``hook_us_per_call``) and set against the handlers' time
(``hook_share_of_handler``). A Prometheus scrape is timed at the end.

Usage: python benchmarks/metrics_cost.py [--batches 2000] [--batch 100] [--rounds 5]
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import struct
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _progress import Steps, note  # noqa: E402

from onceq.broker.broker import Broker  # noqa: E402
from onceq.broker.config import BrokerConfig  # noqa: E402
from onceq.broker.fields import Call  # noqa: E402
from onceq.broker.metrics import BrokerMetrics, Histogram, _timed  # noqa: E402
from onceq.log.record import encode_part  # noqa: E402
from onceq.protocol.codes import RequestCode  # noqa: E402
from onceq.protocol.requests import Pull, SendBatch  # noqa: E402
from onceq.storage.config import StoreConfig  # noqa: E402

TOPIC = "bench"
_U32 = struct.Struct("<I")
_serial = itertools.count()


def payloads(n: int, batch: int) -> list[bytes]:
    body = b"x" * 100
    out = []
    for _ in range(n):
        parts = [encode_part(body, f"K{next(_serial):024X}", 1) for _ in range(batch)]
        out.append(b"".join(_U32.pack(len(p)) + p for p in parts))
    return out


class _Call(Call):
    """A request answered in this process: the handlers return their replies here (async
    flush, nothing held), so no connection is needed."""

    def __init__(self, corr: int) -> None:
        super().__init__(None, corr)  # type: ignore[arg-type]


def run(b: Broker, loads: list[bytes], batch: int, start: int) -> tuple[float, float]:
    """(us per send batch, us per pull batch)."""
    _, send = b.handlers[RequestCode.SEND_BATCH]
    _, pull = b.handlers[RequestCode.PULL]
    t0 = time.perf_counter()
    for i, p in enumerate(loads):
        res = send(_Call(i), SendBatch(TOPIC, 0, p))
        assert res is not None and len(res.offsets) == batch, res
    t1 = time.perf_counter()
    offset = start
    end = start + len(loads) * batch
    n = 0
    while offset < end:
        res = pull(_Call(n), Pull(TOPIC, 0, offset, batch))
        assert res is not None and res.count > 0, res
        offset = res.next
        n += 1
    t2 = time.perf_counter()
    return (t1 - t0) / len(loads) * 1e6, (t2 - t1) / n * 1e6


def hook_cost(m: BrokerMetrics, n: int = 200_000) -> dict[str, float]:
    """Microseconds per call of each hook, measured alone (the handlers' noise left out)."""
    def per_call(fn: object) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()  # type: ignore[operator]
        return (time.perf_counter() - t0) / n * 1e6

    def noop(*_args: object) -> None:
        return None

    timed = _timed(noop, Histogram())
    base = min(per_call(noop) for _ in range(3))
    return {
        "on_send": round(min(per_call(lambda: m.on_send(TOPIC, 100, 15_000, 0))
                             for _ in range(3)) - base, 3),
        "on_pull": round(min(per_call(lambda: m.on_pull(TOPIC, 100, 15_000))
                             for _ in range(3)) - base, 3),
        "timer": round(min(per_call(timed) for _ in range(3)) - base, 3),
    }


async def main_async(a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="onceq-metrics-cost-") as d:
        brokers = {}
        for name, port in (("off", -1), ("on", 0)):
            cfg = BrokerConfig(StoreConfig(os.path.join(d, name)), port=0, metrics_port=port)
            brokers[name] = Broker(cfg)
            await brokers[name].start()
            brokers[name].store.create_topic(TOPIC, 1)
        results: dict[str, dict[str, list[float]]] = {
            k: {"send": [], "pull": []} for k in brokers}
        steps = Steps(a.rounds * 2 + 2)
        try:
            steps.next("warm-up round of both (not counted)")
            for b in brokers.values():
                run(b, payloads(a.batches, a.batch), a.batch, 0)
            for r in range(a.rounds):
                order = list(brokers) if r % 2 == 0 else list(reversed(brokers))
                for name in order:  # alternating, so that a drift hits both alike
                    steps.next(f"metrics {name}: {a.batches} batches of {a.batch}, "
                               f"round {r + 1}/{a.rounds}")
                    loads = payloads(a.batches, a.batch)
                    s, p = run(brokers[name], loads, a.batch, (r + 1) * a.batches * a.batch)
                    results[name]["send"].append(s)
                    results[name]["pull"].append(p)
                    note(f"  send {s:.1f} us/batch, pull {p:.1f} us/batch")
            on = brokers["on"]
            assert on.metrics is not None
            t0 = time.perf_counter()
            text = await on.metrics.render()
            scrape_ms = (time.perf_counter() - t0) * 1000
            steps.next("the hooks alone")
            hooks = hook_cost(on.metrics)
        finally:
            for b in brokers.values():
                await b.stop()
    med = {k: {op: round(statistics.median(v), 2) for op, v in ops.items()}
           for k, ops in results.items()}
    ratio = {op: round(statistics.median(
        on / off for on, off in zip(results["on"][op], results["off"][op], strict=True)), 4)
        for op in ("send", "pull")}
    per_send = hooks["on_send"] + hooks["timer"]
    per_pull = hooks["on_pull"] + hooks["timer"]
    return {"workload": {"batches": a.batches, "batch": a.batch, "body_bytes": 100,
                         "rounds": a.rounds},
            "us_per_batch": med, "on_vs_off": ratio,
            "hook_us_per_call": hooks,
            "hook_share_of_handler": {
                "send": round(per_send / med["off"]["send"], 5),
                "pull": round(per_pull / med["off"]["pull"], 5)},
            "scrape_ms": round(scrape_ms, 2), "scrape_bytes": len(text)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    print(json.dumps(asyncio.run(main_async(ap.parse_args())), indent=2))


if __name__ == "__main__":
    main()
