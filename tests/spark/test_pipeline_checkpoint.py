"""The pipeline's checkpoint belongs to one sink (database and tables): the default one is
derived from the database, prefix and topic, and a checkpoint with the progress of another
sink is refused. A failed query is one error that names its broker cause."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from onceq.client.connection import ConnectionLost
from onceq.spark import pipeline
from onceq.spark.orders import expected_totals, make_orders, send_orders
from onceq.spark.pipeline import PipelineConfig, run_pipeline
from tests.helpers import free_port, spawn_broker

from .conftest import create_topic

pytestmark = pytest.mark.timeout(300)


def totals(result) -> dict:
    return {p: (t.quantity, t.orders) for p, t in result.totals.items()}


def test_default_checkpoint_is_one_per_database(spark, broker_addr, tmp_path, monkeypatch):
    topic = "c_default"
    create_topic(broker_addr, topic, 2)
    events = make_orders(40, products=3, duplicate_rate=0.2, seed=3, prefix="default")
    send_orders(broker_addr, topic, events)
    monkeypatch.chdir(tmp_path)  # the default checkpoints go here
    first = PipelineConfig(servers=broker_addr, topic=topic, database="sqlite:///first.db",
                           watermark="1 hour")
    second = replace(first, database="sqlite:///second.db")
    # the second database, after the first, gets every order too
    assert totals(run_pipeline(spark, first)) == expected_totals(events)
    assert totals(run_pipeline(spark, second)) == expected_totals(events)

    a, b = first.checkpoint_location, second.checkpoint_location
    assert a != b and a.startswith(str(tmp_path)) and b.startswith(str(tmp_path))
    assert a == PipelineConfig(servers=broker_addr, topic=topic,  # stable
                               database=f"sqlite:///{tmp_path}/first.db").checkpoint_location
    assert replace(first, topic="other").checkpoint_location != a
    assert replace(first, table_prefix="other").checkpoint_location != a
    pg = "postgresql://app:secret@db:5432/shop"
    assert pipeline.sink_identity(pg, "p")["database"] == "postgresql://app@db:5432/shop"
    assert (replace(first, database=pg).checkpoint_location
            == replace(first, database=pg.replace("secret", "other")).checkpoint_location)


@pytest.mark.slow
def test_a_checkpoint_of_another_database_is_refused(spark, broker_addr, tmp_path):
    topic = "c_mismatch"
    create_topic(broker_addr, topic, 1)
    events = make_orders(20, products=2, seed=4, prefix="mismatch")
    send_orders(broker_addr, topic, events)
    ckpt = tmp_path / "ckpt"
    config = PipelineConfig(servers=broker_addr, topic=topic, checkpoint=str(ckpt),
                            database=f"sqlite:///{tmp_path}/a.db", watermark="1 hour")
    assert totals(run_pipeline(spark, config)) == expected_totals(events)

    other_db = replace(config, database=f"sqlite:///{tmp_path}/b.db")
    with pytest.raises(ValueError, match=r"holds the progress of a pipeline into "
                                         r"sqlite:///.*/a\.db \(tables onceq_pipeline_\*\)"):
        run_pipeline(spark, other_db)
    with pytest.raises(ValueError, match="holds the progress"):
        run_pipeline(spark, replace(config, table_prefix="other_tables"))
    # the database it was written for goes on from it
    assert totals(run_pipeline(spark, config)) == expected_totals(events)

    # a checkpoint without progress binds nothing: a first run that failed before its
    # first batch (no broker) leaves it free for the next one
    fresh = replace(config, checkpoint=str(tmp_path / "fresh"),
                    servers=f"127.0.0.1:{free_port()}", read_timeout_s=1)
    with pytest.raises(pipeline.PipelineError):
        run_pipeline(spark, fresh)
    fixed = replace(fresh, servers=broker_addr, database=f"sqlite:///{tmp_path}/c.db")
    assert totals(run_pipeline(spark, fixed)) == expected_totals(events)


def test_the_shared_default_checkpoint_of_earlier_versions_is_not_left_behind(
        spark, broker_addr, tmp_path, monkeypatch):
    topic = "c_legacy"
    create_topic(broker_addr, topic, 1)
    events = make_orders(10, products=2, seed=5, prefix="legacy")
    send_orders(broker_addr, topic, events)
    monkeypatch.chdir(tmp_path)
    old = PipelineConfig(servers=broker_addr, topic=topic, database="sqlite:///a.db",
                         checkpoint=str(tmp_path / "onceq-pipeline-checkpoint"),
                         watermark="1 hour")
    assert totals(run_pipeline(spark, old)) == expected_totals(events)
    # a run on the default now would start afresh and count every order again
    with pytest.raises(ValueError, match=r"--checkpoint .*onceq-pipeline-checkpoint"):
        run_pipeline(spark, replace(old, checkpoint=None))
    # going on from it counts nothing twice
    assert totals(run_pipeline(spark, old)) == expected_totals(events)


def test_a_failed_query_is_one_error_naming_its_broker_cause(spark, tmp_path):
    proc, addr = spawn_broker(str(tmp_path / "broker"))
    try:
        topic = "c_failed"
        create_topic(addr, topic, 1)
        send_orders(addr, topic, make_orders(20, products=2, seed=6, prefix="failed"))
        config = PipelineConfig(servers=addr, topic=topic, checkpoint=str(tmp_path / "ckpt"),
                                database=f"sqlite:///{tmp_path}/inv.db", trigger="1 second",
                                read_timeout_s=1, timeout_s=120)
        killed = threading.Event()

        def on_batch(_b) -> None:  # the broker goes away for good after the first batch
            if not killed.is_set():
                proc.kill()
                killed.set()

        with pytest.raises(pipeline.PipelineError) as failed:
            run_pipeline(spark, config, on_batch=on_batch)
    finally:
        proc.kill()
        proc.wait(10)
    assert killed.is_set()
    message = str(failed.value)
    assert "\n" not in message and "Traceback" not in message
    assert "failed every attempt for 1 s (option readTimeout)" in message
    assert isinstance(failed.value.broker_error, ConnectionLost)
