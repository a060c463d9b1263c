"""``onceq pipeline``: the exactly-once Spark pipeline from an order topic into inventory
totals in a database (needs the ``spark`` extra and Java 17+)."""

from __future__ import annotations

import contextlib
import logging
import signal
import sqlite3
import sys
import threading
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.table import Table

from ..idempotency.store import StoreError
from ..protocol.errors import OnceqError
from .common import broker_option, exit_for

EXIT_FAILED = 1  # the query failed for another reason than the broker (database, Spark)


@click.command("pipeline")
@broker_option
@click.option("--topic", "-t", default="orders", show_default=True,
              help="Topic of the order events (JSON: order_id, product, quantity, "
                   "event_time).")
@click.option("--group", "-g", default=None,
              help="Consumer group the pipeline's progress is committed under "
                   "[default: pipeline-<topic>].")
@click.option("--checkpoint", "-c", default=None,
              help="Spark checkpoint directory (keep it to continue where a run stopped; "
                   "refused if it holds the progress of another database or --prefix) "
                   "[default: ./onceq-pipeline-checkpoint-<hash of the database, prefix and "
                   "topic>].")
@click.option("--database", "-d", default="sqlite:///onceq-pipeline.db", show_default=True,
              help="sqlite:///file.db, postgresql://user@host/db or mysql://user@host/db.")
@click.option("--trigger", default="available-now", show_default=True,
              help="'available-now' (read what is there and stop) or an interval such as "
                   "'10 seconds' (run until Ctrl-C or --timeout).")
@click.option("--watermark", default="10 minutes", show_default=True,
              help="How long duplicates are dropped by Spark (event time).")
@click.option("--starting-offsets", default="earliest", show_default=True,
              help="Where a new checkpoint starts: earliest, latest or JSON per queue.")
@click.option("--max-messages-per-trigger", type=click.IntRange(1), default=None,
              help="At most this many messages per micro-batch.")
@click.option("--no-order-ids", is_flag=True,
              help="Do not keep the counted order ids (totals summed by Spark; a duplicate "
                   "arriving after the watermark is then counted twice).")
@click.option("--prefix", default="onceq_pipeline", show_default=True,
              help="Prefix of the pipeline's tables.")
@click.option("--timeout", type=click.FloatRange(0, min_open=True), default=None,
              help="Stop an interval-triggered pipeline after this many seconds.")
@click.option("--read-timeout", type=click.IntRange(1), default=None,
              help="Seconds the pipeline keeps retrying a broker that fails or cannot be "
                   "reached (a restart) before it fails [default: the source's readTimeout, "
                   "60].")
@click.option("--master", default="local[2]", show_default=True, help="Spark master.")
@click.option("--shuffle-partitions", default=4, show_default=True, type=click.IntRange(1),
              help="Partitions of the dedup state (fixed once the checkpoint exists).")
def pipeline(broker: str, topic: str, group: str | None, checkpoint: str | None, database: str,
             trigger: str, watermark: str, starting_offsets: str,
             max_messages_per_trigger: int | None, no_order_ids: bool, prefix: str,
             timeout: float | None, read_timeout: int | None, master: str,
             shuffle_partitions: int) -> None:
    """Order events -> dedup (watermark + order ids) -> inventory totals, exactly once.

    Each micro-batch is one database transaction that records (query id, batch id) with
    the totals, so a batch replayed after a restart changes nothing.
    """
    try:
        from ..spark.inventory import open_dialect
        from ..spark.pipeline import (
            CheckpointMismatch,
            PipelineConfig,
            PipelineError,
            check_broker,
            local_spark,
            run_pipeline,
        )
    except ImportError as exc:
        raise click.ClickException(f"the pipeline needs the spark extra "
                                   f"(pip install 'onceq[spark]'): {exc}") from None
    try:
        open_dialect(database)  # a bad URL fails before Spark starts
    except (ImportError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--database") from None
    config = PipelineConfig(
        servers=broker, topic=topic, group=group, checkpoint=checkpoint, database=database,
        trigger=trigger, watermark=watermark, starting_offsets=starting_offsets,
        max_messages_per_trigger=max_messages_per_trigger, keep_order_ids=not no_order_ids,
        table_prefix=prefix, timeout_s=timeout, read_timeout_s=read_timeout)
    try:
        check_broker(config)  # no broker, or no topic: reported before Spark starts
    except OnceqError as exc:
        exit_for(exc)
    console = Console()
    stop = threading.Event()
    on_interrupt = _interrupt_handler(stop)
    previous = signal.signal(signal.SIGINT, on_interrupt)
    spark = None
    try:
        spark = local_spark(master, shuffle_partitions=shuffle_partitions)
        # SparkContext installs a handler of its own that cancels every job from inside
        # the signal handler, in the middle of whatever JVM call the main thread makes
        signal.signal(signal.SIGINT, on_interrupt)
        _quiet_query_failure(spark)
        result = run_pipeline(spark, config, on_batch=lambda b: console.print(b.line()),
                              stop=stop)
    except KeyboardInterrupt:  # a second Ctrl-C
        raise SystemExit(130) from None
    except CheckpointMismatch as exc:
        raise click.BadParameter(str(exc), param_hint="--checkpoint") from None
    except PipelineError as exc:
        if exc.broker_error is not None:
            exit_for(exc.broker_error)
        _fail(str(exc))
    except (RuntimeError, ValueError, StoreError, sqlite3.Error) as exc:
        _fail(f"{type(exc).__name__}: {exc}")
    finally:
        if spark is not None:
            spark.stop()
        signal.signal(signal.SIGINT, previous)
    console.print(f"query {result.query_id}: {len(result.batches)} batches, "
                  f"{result.rows_in} rows in, {result.duplicates_dropped} duplicates dropped, "
                  f"{result.orders_counted} orders counted, {result.rows_upserted} rows "
                  f"upserted, {result.replayed_batches} replayed batches left unchanged")
    table = Table("product", "quantity", "orders", title=f"inventory ({database})")
    for product, total in result.totals.items():
        table.add_row(product, str(total.quantity), str(total.orders))
    console.print(table)


def _fail(message: str) -> NoReturn:
    """A failure that is not the broker's: one ``error:`` line, exit code 1."""
    first = next((line for line in message.splitlines() if line.strip()), message)
    click.echo(f"error: {first}", err=True)
    sys.exit(EXIT_FAILED)


def _interrupt_handler(stop: threading.Event) -> Any:
    """Ctrl-C stops the pipeline as ``--timeout`` does (a batch cut short is run again by
    the next run, and applied once), then the totals are printed; a second Ctrl-C
    aborts."""

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        with contextlib.suppress(RuntimeError, OSError):  # stderr busy in the main thread
            click.echo("stopping the pipeline (Ctrl-C again to abort)", err=True)

    return handler


def _quiet_query_failure(spark: Any) -> None:
    """A failed query is reported on one ``error:`` line: Spark's own logs of the failure
    (ERROR lines with whole traces, from the query, the scheduler and the executors) and
    py4j's are left out, unless onceq logs at INFO or below (``onceq --log-level``)."""
    if logging.getLogger().getEffectiveLevel() <= logging.INFO:
        return
    spark.sparkContext.setLogLevel("OFF")
    logging.getLogger("py4j").setLevel(logging.CRITICAL)
