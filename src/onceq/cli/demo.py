"""``onceq demo``: the main job on embedded defaults.

A broker in a temp directory; a producer sends a batch of orders (and retries one send,
which the broker recognises); a consumer group of push consumers handles them while a
second member joins and the first leaves (two rebalances) and one order fails once and is
retried. Every delivery is counted per unique key: duplicates and losses are reported.
"""

from __future__ import annotations

import asyncio
import collections
import tempfile
import time

from rich.console import Console
from rich.table import Table

from ..broker.broker import Broker
from ..broker.config import BrokerConfig
from ..client.admin import Admin
from ..client.message import Message
from ..client.producer import Producer
from ..client.push import ConsumeStatus, PushConsumer
from ..storage.config import StoreConfig

# short retry delays so the demo's retried order comes back within a second
DEMO_DELAY_LEVELS = "100ms 200ms 300ms 500ms 1s 2s 5s 10s 30s 1m 2m 5m 10m 20m 30m 1h 2h 3h"


async def run_demo(n: int, queues: int, console: Console) -> bool:
    with tempfile.TemporaryDirectory(prefix="onceq-demo-") as data_dir:
        broker = Broker(BrokerConfig(StoreConfig(data_dir), port=0,
                                     delay_levels=DEMO_DELAY_LEVELS))
        await broker.start()
        addr = f"127.0.0.1:{broker.port}"
        console.print(f"broker on {addr}, data in {data_dir}")
        try:
            return await _run(addr, n, queues, console)
        finally:
            await broker.stop()


async def _run(addr: str, n: int, queues: int, console: Console) -> bool:
    async with Admin(addr) as admin:
        await admin.create_topic("orders", queues)
    seen: collections.Counter[str] = collections.Counter()
    failed_once: set[str] = set()
    retried: list[int] = []

    def member(name: str) -> PushConsumer:
        async def handle(msgs, ctx):
            await asyncio.sleep(0.001)  # a little work per order
            for m in msgs:
                if m.keys == "order-7" and m.unique_key not in failed_once:
                    failed_once.add(m.unique_key)
                    return ConsumeStatus.RECONSUME_LATER  # fails once, comes back
                if m.reconsume_times:
                    retried.append(m.reconsume_times)
                seen[m.unique_key] += 1
            return None

        c = PushConsumer(addr, "billing", handle, consume_from="FIRST", instance_name=name)
        c.subscribe("orders")
        return c

    first = await member("first").start()
    t0 = time.perf_counter()
    sent: dict[str, tuple[int, int]] = {}
    async with Producer(addr) as producer:
        orders = [Message(f"order-{i}".encode(), tags="created", keys=f"order-{i}")
                  for i in range(n)]
        second = None
        for i in range(0, n, 100):
            for r in await producer.send_batch("orders", orders[i:i + 100]):
                sent[r.unique_key] = (r.queue_id, r.offset)
            if second is None and i >= n // 3:
                second = await member("second").start()  # joins: rebalance
            await asyncio.sleep(0.005)
        # a producer retry of an already stored message is recognised by the broker
        again = await producer.send("orders", Message(b"order-0", unique_key=next(iter(sent))))
    t_prod = time.perf_counter() - t0
    await first.shutdown()  # leaves: its queues move to the second member after draining
    deadline = time.monotonic() + 20
    while set(seen) != set(sent) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    t_all = time.perf_counter() - t0
    assert second is not None
    await second.shutdown()

    dups = sum(c - 1 for c in seen.values())
    lost = len(set(sent) - set(seen))
    table = Table(title="onceq demo: orders -> consumer group 'billing'")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("orders produced", f"{len(sent):,}")
    table.add_row("produce rate (msg/s, producer paced with the consumers)",
                  f"{len(sent) / t_prod:,.0f}")
    table.add_row("retried send recognised as duplicate by the broker", str(again.duplicate))
    table.add_row("group changes while consuming", "'second' joined, 'first' left")
    table.add_row("order that failed once, redelivered with reconsume count",
                  ", ".join(map(str, retried)) or "-")
    table.add_row("orders handled", f"{sum(seen.values()):,}")
    table.add_row("end-to-end time (s)", f"{t_all:.2f}")
    table.add_row("duplicate deliveries", str(dups))
    table.add_row("lost", str(lost))
    console.print(table)
    return lost == 0 and dups == 0 and again.duplicate and retried == [1]
