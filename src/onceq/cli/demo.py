"""``onceq demo``: the main job on embedded defaults."""

from __future__ import annotations

import tempfile
import time

from rich.console import Console
from rich.table import Table

from ..broker.broker import Broker
from ..broker.config import BrokerConfig
from ..client.admin import Admin
from ..client.message import Message
from ..client.producer import Producer
from ..client.pull import PullConsumer
from ..storage.config import StoreConfig


async def run_demo(n: int, queues: int, console: Console) -> bool:
    with tempfile.TemporaryDirectory(prefix="onceq-demo-") as data_dir:
        broker = Broker(BrokerConfig(StoreConfig(data_dir), port=0))
        await broker.start()
        addr = f"127.0.0.1:{broker.port}"
        console.print(f"broker on {addr}, data in {data_dir}")
        try:
            async with Admin(addr) as admin:
                await admin.create_topic("demo", queues)
            t0 = time.perf_counter()
            sent: dict[str, tuple[int, int]] = {}
            async with Producer(addr) as producer:
                batch = [Message(f"order-{i}".encode(), tags="demo", keys=f"order-{i}")
                         for i in range(n)]
                for i in range(0, n, 100):
                    for r in await producer.send_batch("demo", batch[i:i + 100]):
                        sent[r.unique_key] = (r.queue_id, r.offset)
                # a producer retry of an already stored message is recognised by the broker
                again = await producer.send(
                    "demo", Message(b"order-0", unique_key=next(iter(sent))))
            t_prod = time.perf_counter() - t0
            t0 = time.perf_counter()
            got: dict[str, int] = {}
            async with PullConsumer(addr, "demo-group") as consumer:
                for q in range(queues):
                    offset = max(await consumer.fetch_offset("demo", q), 0)
                    while True:
                        r = await consumer.pull("demo", q, offset, 256)
                        if not r.messages:
                            break
                        for m in r.messages:
                            got[m.unique_key] = got.get(m.unique_key, 0) + 1
                        offset = r.next_offset
                    await consumer.commit_offset("demo", q, offset)
            t_cons = time.perf_counter() - t0
        finally:
            await broker.stop()
    dups = sum(c - 1 for c in got.values())
    lost = len(set(sent) - set(got))
    table = Table(title="onceq demo")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("messages produced", str(len(sent)))
    table.add_row("produce rate (msg/s)", f"{len(sent) / t_prod:,.0f}")
    table.add_row("retried send recognised as duplicate", str(again.duplicate))
    table.add_row("messages consumed", str(sum(got.values())))
    table.add_row("consume rate (msg/s)", f"{sum(got.values()) / t_cons:,.0f}")
    table.add_row("duplicates", str(dups))
    table.add_row("lost", str(lost))
    console.print(table)
    return lost == 0 and dups == 0 and again.duplicate
