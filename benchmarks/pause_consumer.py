"""One consumer process of the paused-member benchmark (see pause_chaos.py).

A PushConsumer in a CLUSTERING group (short heartbeat, rebalance and commit intervals, so it
notices membership changes quickly) that appends one line per message to ``out``, flushed as
it goes::

    D <order> <topic:queue:offset[/retryN]> <name> <wall time>   delivered to the listener
    B <order> <topic:queue:offset[/retryN]> <name> <wall time>   the handler started on it
    E <order> <topic:queue:offset[/retryN]> <name> <wall time>   the handler finished it

With ``--idempotency URL`` the consumer's idempotency option guards the handler: D lines are
what the consumer delivered, B and E lines what the guard let through, and the handler's
business effect is one row in the table effects(order_id) of the SQLite file ``--effects``.
Without it the effect is the handler call itself.

``--pause-from K`` arms the pause: the handler of the first order >= K this consumer gets
works ``--hold-s`` (in steps of 50 ms of running time), for the parent to SIGSTOP the process
in there; the rest of that work runs after SIGCONT. Every step rewrites the marker file
(JSON: wall time, order, the messages the consumer holds unacknowledged, cached or in a
listener call, and per queue the offset it would commit), so the last one tells the state at
the stop.
SIGTERM shuts it down gracefully and writes its counters to ``out.stats``.
A file ``out.ready`` appears once it is consuming.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import os
import signal
import sqlite3
import time
from typing import Any

from _progress import note

from onceq.client.push import PushConsumer


class DeliveryLog:
    """A listener that logs each delivered message (D line), then calls ``inner``."""

    def __init__(self, inner: Any, write: Any) -> None:
        self.inner = inner
        self.write = write

    async def __call__(self, msgs: list, ctx: Any) -> Any:
        self.write("D", msgs)
        result = self.inner(msgs, ctx)
        if inspect.isawaitable(result):
            result = await result
        return result

    def __getattr__(self, name: str) -> Any:  # hooks of the guard (on_consumer_start, ...)
        return getattr(self.inner, name)


class LoggedConsumer(PushConsumer):
    """A PushConsumer whose listener (the idempotency guard when there is one) is wrapped in
    a :class:`DeliveryLog`, so deliveries are logged before the guard decides."""

    _delivery_log: DeliveryLog | None = None
    log_write: Any = None

    @property
    def listener(self) -> Any:
        inner = super().listener
        if inner is None:
            return None
        log = self._delivery_log
        if log is None or log.inner is not inner:
            log = self._delivery_log = DeliveryLog(inner, self.log_write)
        return log


def held_messages(c: PushConsumer) -> tuple[int | None, dict[str, int]]:
    """Messages ``c`` holds unacknowledged (cached or in a handler) and, per queue, the
    offset it would commit; (None, {}) when the consumer does not expose them."""
    try:
        pqs = [(mq, pq) for mq, pq in c.owned.items() if not pq.dropped]
        return (sum(len(pq) for _, pq in pqs),
                {f"{mq.topic}:{mq.queue_id}": pq.commit_offset for mq, pq in pqs})
    except AttributeError:
        return None, {}


def where(m) -> str:
    """``topic:queue:offset``, and ``/retryN`` for the N-th redelivery of a retried message
    (it is then read from the group's retry topic at that queue and offset)."""
    n = getattr(m, "reconsume_times", 0)
    return f"{m.topic}:{m.queue_id}:{m.queue_offset}" + (f"/retry{n}" if n else "")


async def main(a: argparse.Namespace) -> None:
    f = open(a.out, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def write(kind: str, msgs: list) -> None:
        now = time.time()
        f.write("".join(f"{kind} {m.body.decode()} {where(m)} {a.name} {now:.6f}\n"
                        for m in msgs))

    db = None
    if a.effects:
        db = sqlite3.connect(a.effects, isolation_level=None, timeout=30)
    armed = a.pause_from >= 0
    consumer: LoggedConsumer | None = None

    async def handle(msgs, ctx):
        nonlocal armed
        write("B", msgs)
        if armed and any(int(m.body) >= a.pause_from for m in msgs):
            armed = False
            # the handler's work: steps of running time, so that what is left when the
            # parent stops the process in here runs after it continues; each step rewrites
            # the marker, so it tells the state of the consumer when it was stopped
            for step in range(max(round(a.hold_s / 0.05), 1)):
                held, commit_offsets = held_messages(consumer)
                tmp = a.marker + ".tmp"
                with open(tmp, "w") as fh:
                    json.dump({"t": time.time(), "step": step,
                               "orders": [int(m.body) for m in msgs], "held": held,
                               "commit_offsets": commit_offsets}, fh)
                os.replace(tmp, a.marker)
                await asyncio.sleep(0.05)
        if a.handler_ms > 0:
            await asyncio.sleep(a.handler_ms / 1000)
        if db is not None:
            db.executemany("INSERT INTO effects(order_id, consumer, t) VALUES (?, ?, ?)",
                           [(int(m.body), a.name, time.time()) for m in msgs])
        write("E", msgs)

    kw: dict[str, Any] = {}
    if a.idempotency:
        kw["idempotency"] = a.idempotency
    consumer = LoggedConsumer(a.addr, a.group, handle, consume_from="FIRST",
                              instance_name=a.name, heartbeat_interval_s=a.heartbeat_s,
                              rebalance_interval_s=a.rebalance_s, pull_suspend_s=1,
                              commit_interval_s=1, concurrency=a.concurrency, **kw)
    consumer.log_write = write
    consumer.subscribe(a.topic)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await consumer.start()
    note(f"{a.name}: consuming {a.topic} in group {a.group}"
         f"{' (idempotent)' if a.idempotency else ''}")
    open(a.out + ".ready", "w").close()
    await stop.wait()
    await consumer.shutdown()
    note(f"{a.name}: stopped")
    f.close()
    stats = dict(consumer.stats)
    guard = consumer.idempotent_listener
    if guard is not None:
        stats.update({f"idempotency_{k}": v for k, v in guard.stats.items()})
    with open(a.out + ".stats", "w") as fh:
        json.dump(stats, fh)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("addr")
    ap.add_argument("group")
    ap.add_argument("topic")
    ap.add_argument("name")
    ap.add_argument("out")
    ap.add_argument("--idempotency", default="", help="dedup store URL (default: none)")
    ap.add_argument("--effects", default="", help="SQLite file of the effects table")
    ap.add_argument("--handler-ms", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=1, help="listener calls at once")
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--rebalance-s", type=float, default=2.0)
    ap.add_argument("--pause-from", type=int, default=-1, help="-1: never pause")
    ap.add_argument("--marker", default="")
    ap.add_argument("--hold-s", type=float, default=3.0)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: the parent stops everything
        asyncio.run(main(ap.parse_args()))
