"""``onceq audit``: duplicate deliveries per group, queue and time window, by cause."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .common import broker_option

console = Console()


@click.command("audit")
@click.option("--group", "-g", "groups", multiple=True,
              help="Audit this group (repeatable; default: every traced group).")
@click.option("--window", default="1 minute", show_default=True,
              help="Time window of the per-queue counts (a Spark interval: '30 seconds').")
@click.option("--json", "json_path", default=None, metavar="PATH",
              help="Write the report as JSON to PATH ('-': standard output, no table).")
@click.option("--parquet", "parquet_dir", default=None, type=click.Path(file_okay=False),
              help="Write every traced delivery with its duplicate flag and cause to this "
                   "Parquet directory (replaced).")
@click.option("--master", default="local[2]", show_default=True, help="Spark master.")
@click.option("--max-rows", default=40, show_default=True, type=click.IntRange(1),
              help="Most window rows in the terminal table (those with duplicates).")
@broker_option
def audit(groups: tuple[str, ...], window: str, json_path: str | None,
          parquet_dir: str | None, master: str, max_rows: int, broker: str) -> None:
    """Duplicate deliveries of the groups with tracing on (`onceq group trace GROUP on`),
    each attributed to its cause: rebalance, crash, broker_restart, retry or
    producer_resend (a Spark batch job over the topic %TRACE%; see docs/admin.md)."""
    try:
        from ..spark.audit import CAUSES, audit_session, run_audit
    except ImportError as exc:
        raise click.ClickException(f"onceq audit needs the spark extra "
                                   f"(pip install 'onceq[spark]'): {exc}") from None
    from ..client.sync import SyncPullConsumer

    try:  # a clear error before Spark starts
        with SyncPullConsumer(broker, "onceq-audit") as c:
            c.queue_count("%TRACE%")
    except Exception as exc:
        raise click.ClickException(f"cannot read the trace topic %TRACE% at {broker}: {exc} "
                                   "(turn tracing on with `onceq group trace GROUP on`)"
                                   ) from None
    spark, own = audit_session(master)
    try:
        report = run_audit(spark, broker, groups=groups or None, window=window)
        if parquet_dir:
            assert report.deliveries is not None
            report.deliveries.write.mode("overwrite").parquet(parquet_dir)
    finally:
        if own:
            spark.stop()
    doc = report.to_json()
    if json_path == "-":
        click.echo(json.dumps(doc, default=str))
        return
    if json_path:
        with open(json_path, "w") as f:
            json.dump(doc, f, default=str, indent=1)
    _print(report.groups, report.windows, CAUSES, max_rows)
    if groups and not report.groups:
        raise click.ClickException(f"no traced delivery of {', '.join(groups)}")


def _print(groups: list[dict[str, Any]], windows: list[dict[str, Any]],
           causes: tuple[str, ...], max_rows: int) -> None:
    if not groups:
        console.print("no traced delivery")
        return
    t = Table("group", "deliveries", "unique keys", "duplicates", *causes, "after handover",
              title="duplicate deliveries by cause")
    for g in groups:
        t.add_row(Text(g["group"]), str(g["deliveries"]), str(g["unique_keys"]),
                  str(g["duplicates"]), *(str(g["causes"][c]) for c in causes),
                  str(g["handover_deliveries"]))
    console.print(t)
    rows = [w for w in windows if w["duplicates"]]
    if not rows:
        return
    t = Table("group", "topic", "queue", "window start", "deliveries", "duplicates", *causes,
              title=f"windows with duplicates ({min(len(rows), max_rows)} of {len(rows)})")
    for w in rows[:max_rows]:
        t.add_row(Text(w["group"]), Text(w["topic"]), str(w["queue"]), w["window_start"],
                  str(w["deliveries"]), str(w["duplicates"]),
                  *(str(w["causes"][c]) for c in causes))
    console.print(t)


def register(main: click.Group) -> None:
    main.add_command(audit)
