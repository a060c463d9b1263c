"""``onceq broker verify`` (offline check of a data directory) and ``onceq broker status``."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime

import click
from rich.console import Console
from rich.table import Table

from ..client.admin import Admin
from .common import async_command, broker_option

EXIT_DAMAGED = 1  # verify found damage


def register(broker: click.Group) -> None:
    broker.add_command(verify)
    broker.add_command(status)


@click.command("verify")
@click.option("--data-dir", "-d", required=True, type=click.Path(file_okay=False, exists=True),
              help="Data directory of a stopped broker (or a copy of it).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify(data_dir: str, as_json: bool) -> None:
    """Check every record checksum and index entry offline; exit 1 on damage.

    Reads only: a broker started on the directory repairs index entries it can and skips
    damaged offsets with the DAMAGED pull status.
    """
    from ..storage.verify import verify_store

    report = verify_store(data_dir)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1))
    else:
        console = Console()
        console.print(f"{report.segments} segment(s), {report.log_bytes} bytes, "
                      f"{report.records} record(s)")
        if report.log:
            t = Table("log start", "log end", "bytes", "reason", title="damaged commit log")
            for d in report.log:
                t.add_row(str(d.start), str(d.end), str(d.end - d.start), d.reason)
            console.print(t)
        if report.queues:
            t = Table("topic", "queue", "offsets", "reason", title="damaged queue offsets")
            for q in report.queues:
                span = str(q.first) if q.first == q.last else f"{q.first}..{q.last}"
                t.add_row(q.topic, str(q.queue_id), span, q.reason)
            console.print(t)
        if not report.damaged:
            console.print("no damage found")
    sys.exit(EXIT_DAMAGED if report.damaged else 0)


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@broker_option
@async_command
async def status(as_json: bool, broker: str) -> None:
    """Store health of a running broker: log range, damaged ranges, dedup window, recent
    warnings and errors."""
    async with Admin(broker) as admin:
        st = await admin.broker_status()
    if as_json:
        click.echo(json.dumps(st, indent=1))
        return
    click.echo(f"commit log [{st['log_start']}, {st['log_end']}), flush={st['flush']}")
    w = st.get("writes")
    if w is not None:
        usage = f"disk {w['disk_used']:.0%} used, limit {w['disk_max_used']:.0%}"
        click.echo(f"writes accepted ({usage})" if w["accepted"]
                   else f"writes refused: {w['reason']} ({usage})")
    dd = st.get("dedup")
    if dd:
        click.echo(f"dedup window {dd['window_s']:g} s (effective {dd['effective_window_s']:g} s), "
                   f"{dd['keys']} keys of at most {dd['max_keys']}")
    damaged = st["damaged"]
    for a, b in damaged.get("log", []):
        click.echo(f"damaged log positions [{a}, {b})")
    for topic, qs in sorted(damaged.get("queues", {}).items()):
        for qid, ranges in sorted(qs.items(), key=lambda kv: int(kv[0])):
            for lo, hi in ranges:
                click.echo(f"damaged {topic}[{qid}] offsets {lo}..{hi - 1}")
    if not damaged.get("log") and not damaged.get("queues"):
        click.echo("no damage recorded")
    errors = st.get("recent_errors") or []
    click.echo(f"{len(errors)} warning(s) and error(s) since the broker started"
               + (", the newest:" if errors else ""))
    for e in errors[-5:]:
        when = datetime.fromtimestamp(e["ts_ms"] / 1000, UTC).strftime("%H:%M:%S")
        click.echo(f"  {when} {e['level']} {e['logger']}: {e['message']}")
