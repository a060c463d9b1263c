"""``onceq pipeline``: the exactly-once Spark pipeline from an order topic into inventory
totals in a database (needs the ``spark`` extra and Java 17+)."""

from __future__ import annotations

import threading

import click
from rich.console import Console
from rich.table import Table

from .common import broker_option


@click.command("pipeline")
@broker_option
@click.option("--topic", "-t", default="orders", show_default=True,
              help="Topic of the order events (JSON: order_id, product, quantity, "
                   "event_time).")
@click.option("--group", "-g", default=None,
              help="Consumer group the pipeline's progress is committed under "
                   "[default: pipeline-<topic>].")
@click.option("--checkpoint", "-c", default="onceq-pipeline-checkpoint", show_default=True,
              help="Spark checkpoint directory (keep it to continue where a run stopped).")
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
@click.option("--master", default="local[2]", show_default=True, help="Spark master.")
@click.option("--shuffle-partitions", default=4, show_default=True, type=click.IntRange(1),
              help="Partitions of the dedup state (fixed once the checkpoint exists).")
def pipeline(broker: str, topic: str, group: str | None, checkpoint: str, database: str,
             trigger: str, watermark: str, starting_offsets: str,
             max_messages_per_trigger: int | None, no_order_ids: bool, prefix: str,
             timeout: float | None, master: str, shuffle_partitions: int) -> None:
    """Order events -> dedup (watermark + order ids) -> inventory totals, exactly once.

    Each micro-batch is one database transaction that records (query id, batch id) with
    the totals, so a batch replayed after a restart changes nothing.
    """
    try:
        from ..spark.inventory import open_dialect
        from ..spark.pipeline import PipelineConfig, local_spark, run_pipeline
    except ImportError as exc:
        raise click.ClickException(f"the pipeline needs the spark extra "
                                   f"(pip install 'onceq[spark]'): {exc}") from None
    try:
        open_dialect(database)  # a bad URL fails before Spark starts
    except (ImportError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--database") from None
    console = Console()
    config = PipelineConfig(
        servers=broker, topic=topic, group=group, checkpoint=checkpoint, database=database,
        trigger=trigger, watermark=watermark, starting_offsets=starting_offsets,
        max_messages_per_trigger=max_messages_per_trigger, keep_order_ids=not no_order_ids,
        table_prefix=prefix, timeout_s=timeout)
    spark = local_spark(master, shuffle_partitions=shuffle_partitions)
    stop = threading.Event()
    try:
        result = run_pipeline(spark, config, on_batch=lambda b: console.print(b.line()),
                              stop=stop)
    except KeyboardInterrupt:
        stop.set()
        raise SystemExit(130) from None
    except (RuntimeError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        spark.stop()
    console.print(f"query {result.query_id}: {len(result.batches)} batches, "
                  f"{result.rows_in} rows in, {result.duplicates_dropped} duplicates dropped, "
                  f"{result.orders_counted} orders counted, {result.rows_upserted} rows "
                  f"upserted, {result.replayed_batches} replayed batches left unchanged")
    table = Table("product", "quantity", "orders", title=f"inventory ({database})")
    for product, total in result.totals.items():
        table.add_row(product, str(total.quantity), str(total.orders))
    console.print(table)
