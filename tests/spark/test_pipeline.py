"""The exactly-once pipeline on the shared SparkSession: injected duplicates, a late
duplicate past the watermark, a stop mid-stream, a replayed batch, three databases."""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import replace
from datetime import timedelta

import pytest
from click.testing import CliRunner

from onceq.cli.main import main as cli
from onceq.client.admin import Admin
from onceq.client.sync import SyncProducer
from onceq.spark.inventory import InventoryStore
from onceq.spark.orders import OrderEvent, expected_totals, make_orders, send_orders
from onceq.spark.pipeline import PipelineConfig, run_pipeline
from tests.integration.test_idem_stores import require_server

from .conftest import create_topic

pytestmark = pytest.mark.timeout(300)

def database_url(kind: str, tmp_path) -> str:
    return f"sqlite:///{tmp_path}/inventory.db" if kind == "sqlite" else require_server(kind)


def _forget_last_commit(checkpoint) -> int:
    """Delete Spark's record that the last batch finished (and its checksum file): the
    next run runs that batch again, with the same id. Returns its id."""
    commits = checkpoint / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    (commits / str(last)).unlink()
    (commits / f".{last}.crc").unlink(missing_ok=True)
    return last


def _group_status(addr: str, group: str):
    async def go():
        async with Admin(addr) as admin:
            return await admin.group_status(group)
    return asyncio.run(go())


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mysql"])
@pytest.mark.slow
def test_totals_are_exact_with_duplicates_a_stop_and_a_replayed_batch(
        spark, broker_addr, tmp_path, kind):
    topic = f"p_orders_{kind}"
    create_topic(broker_addr, topic, 3)
    events = make_orders(160, products=4, duplicate_rate=0.25, max_lag=10, seed=7,
                         prefix=f"{kind}-order")
    assert sum(e.duplicate for e in events) > 20
    first, second = events[:100], events[100:]
    # a copy of the first order with a new event time, long after Spark forgot it
    late = replace(first[0], event_time=events[-1].event_time + timedelta(seconds=1),
                   duplicate=True)
    # a new order whose event time is far behind the watermark: Spark drops it (not counted)
    too_late = OrderEvent(f"{kind}-too-late", "product-0", 5, first[0].event_time)
    send_orders(broker_addr, topic, first)
    with SyncProducer(broker_addr) as p:
        p.send(topic, b"not an order")
    # an order id too long for any of the databases' keys: malformed, like the above
    send_orders(broker_addr, topic, [replace(first[1], order_id="x" * 256)])

    prefix = f"onceq_t_{uuid.uuid4().hex[:10]}"
    ckpt = tmp_path / "ckpt"
    config = PipelineConfig(servers=broker_addr, topic=topic, checkpoint=str(ckpt),
                            database=database_url(kind, tmp_path), watermark="30 seconds",
                            max_messages_per_trigger=45, table_prefix=prefix)
    store = InventoryStore(config.database, prefix)
    try:
        runs = []
        if kind == "sqlite":  # (Spark's side of a stop does not depend on the database)
            # run 1: stopped mid-stream, after its first batch
            stop = threading.Event()
            r1 = run_pipeline(spark, config, on_batch=lambda b: stop.set(), stop=stop)
            assert r1.batches and r1.replayed_batches == 0
            assert r1.orders_counted < len({e.order_id for e in first})
            runs.append(r1)
        # run 2: (re)started from the checkpoint, reads the rest of what is there
        r2 = run_pipeline(spark, config)
        assert all(r.query_id == r2.query_id for r in runs)  # same checkpoint, same query
        got = {p: (t.quantity, t.orders) for p, t in r2.totals.items()}
        assert got == expected_totals(first)

        # Spark's record that the last batch finished is lost (as if the driver died
        # after the database commit): run 3 runs that batch again, then the new events
        replayed = _forget_last_commit(ckpt)
        send_orders(broker_addr, topic, [*second, late, too_late])
        r3 = run_pipeline(spark, config)
        again = [b for b in r3.batches if b.replayed]
        assert [b.batch_id for b in again] == [replayed]
        assert again[0].orders_new == 0

        got = {p: (t.quantity, t.orders) for p, t in r3.totals.items()}
        assert got == expected_totals(events)
        assert store.totals() == r3.totals
        runs += [r2, r3]
        assert sum(r.orders_counted for r in runs) == len({e.order_id for e in events})
        batches = [b for r in runs for b in r.batches]
        # a batch run again (after the stop, the replay) counts its input again
        assert sum(b.malformed for b in batches) >= 2
        assert sum(b.late_duplicates for b in batches) >= 1  # the late copy, not counted
        assert sum(b.late_rows for b in batches) >= 1  # the order behind the watermark
        assert sum(r.duplicates_dropped for r in runs) >= sum(e.duplicate for e in events)
        applied = store.applied_batches(r3.query_id)
        assert applied == sorted(set(applied)) and replayed in applied

        # the broker shows the pipeline's progress under its group: nothing left to read
        status = _group_status(broker_addr, config.group_name)
        assert [q.topic for q in status.queues] == [topic] * 3
        assert status.lag == 0
        assert all(q.committed == q.max_offset > 0 for q in status.queues)
        shown = CliRunner().invoke(cli, ["group", "status", config.group_name, "-b",
                                         broker_addr])
        assert shown.exit_code == 0 and "total lag: 0" in shown.output
    finally:
        store.drop_tables()


def test_without_order_ids_totals_come_from_spark(spark, broker_addr, tmp_path):
    """keep_order_ids=False: Spark sums per product; duplicates within the watermark are
    dropped, a replayed batch changes nothing."""
    topic = "p_sums"
    create_topic(broker_addr, topic, 2)
    events = make_orders(80, products=3, duplicate_rate=0.3, max_lag=5, seed=11,
                         prefix="sum-order")
    send_orders(broker_addr, topic, events)
    ckpt = tmp_path / "ckpt"
    config = PipelineConfig(servers=broker_addr, topic=topic, checkpoint=str(ckpt),
                            database=f"sqlite:///{tmp_path}/inv.db", watermark="1 hour",
                            keep_order_ids=False)
    r1 = run_pipeline(spark, config)
    assert {p: (t.quantity, t.orders) for p, t in r1.totals.items()} == expected_totals(events)
    _forget_last_commit(ckpt)
    r2 = run_pipeline(spark, config)
    assert r2.replayed_batches == 1 and r2.totals == r1.totals


def test_bad_database_url_is_a_clear_error(spark, broker_addr, tmp_path):
    config = PipelineConfig(servers=broker_addr, database="oracle://x/y",
                            checkpoint=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="unknown database URL scheme 'oracle'"):
        run_pipeline(spark, config)
    with pytest.raises(ValueError, match="database file"):
        run_pipeline(spark, replace(config, database="sqlite:///:memory:"))


def test_pipeline_command_checks_the_database_url_before_starting_spark():
    run = CliRunner().invoke(cli, ["pipeline", "--database", "oracle://db/x"])
    assert run.exit_code == 2 and "unknown database URL scheme 'oracle'" in run.output


def test_order_events_and_expected_totals():
    events = make_orders(50, products=2, duplicate_rate=0.5, seed=1)
    distinct = {e.order_id: e for e in events if not e.duplicate}
    assert len(distinct) == 50
    assert all(distinct[e.order_id].body() == e.body() for e in events)
    totals = expected_totals(events)
    assert sum(n for _q, n in totals.values()) == 50
    assert sum(q for q, _n in totals.values()) == sum(e.quantity for e in distinct.values())
    assert isinstance(events[0], OrderEvent)
