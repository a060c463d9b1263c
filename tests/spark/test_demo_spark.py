"""The demo's Spark step: the exactly-once pipeline over an order topic with application
re-sends, stopped after its first micro-batch and restarted from its checkpoint."""

from __future__ import annotations

import asyncio

import pytest

from onceq import Admin, Message, Producer
from onceq.cli.demo.shop import make_orders
from onceq.cli.demo.spark_step import SparkStep


@pytest.mark.slow
def test_spark_step_counts_each_order_once(spark, broker_addr, tmp_path):
    topic = "demo-spark"
    orders = make_orders(300, seed=3)
    resent = orders[::30]  # 10 application re-sends: same body, a new unique key

    async def produce() -> None:
        async with Admin(broker_addr) as admin:
            await admin.create_topic(topic, 4)
        async with Producer(broker_addr) as p:
            for o in [*orders, *resent]:
                await p.send(topic, Message(o.body(), keys=o.order_id))

    asyncio.run(produce())
    step = SparkStep(str(tmp_path), session=spark)
    out = asyncio.run(step.run(broker_addr, orders, len(orders) + len(resent), topic))
    assert out.runs == 2
    runs = [b["run"] for b in out.batches]
    assert runs[0] == 1 and 2 in runs  # stopped, then restarted
    first = [b["batch"] for b in out.batches if b["run"] == 1]
    second = [b for b in out.batches if b["run"] == 2]
    # continued from the checkpoint: the batch after the last one of the first run, or
    # that one again if the stop came before Spark committed it (a replay: no change)
    assert second[0]["batch"] in (max(first), max(first) + 1)
    assert out.rows_in == 310
    assert out.duplicates_dropped == 10
    assert out.orders_counted == 300
    assert out.totals_match, (out.inventory, out.expected)
    step.stop()  # the shared session stays up
    assert spark.range(1).count() == 1
