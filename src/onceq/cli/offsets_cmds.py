"""``onceq offsets``: show a topic's offsets (and a group's), reset a group's offsets."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ..client.admin import Admin
from .common import OFFSET, WIRE_INT, async_command, broker_option

console = Console()


class _OffsetsGroup(click.Group):
    """``onceq offsets TOPIC ...`` still shows offsets: arguments that name no subcommand
    go to ``show``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["show", *args]
        return super().parse_args(ctx, args)


@click.group("offsets", cls=_OffsetsGroup)
def offsets() -> None:
    """Show (offsets TOPIC) or reset (offsets reset) consumer offsets."""


@offsets.command("show")
@click.argument("topic_name", metavar="TOPIC")
@click.option("--group", "-g", default=None, help="Show this group's committed offsets and lag.")
@broker_option
@async_command
async def offsets_show(topic_name: str, group: str | None, broker: str) -> None:
    """Show min/max offsets per queue of TOPIC (and a group's committed offset and lag)."""
    async with Admin(broker) as admin:
        rows = await admin.topic_offsets(topic_name)
        table = Table("queue", "min", "max", *(("committed", "lag") if group else ()))
        for q, (lo, hi) in enumerate(rows):
            extra: tuple[str, ...] = ()
            if group:
                c = await admin.group_offset(group, topic_name, q)
                extra = ("-", str(hi - lo)) if c is None else (str(c), str(hi - max(c, lo)))
            table.add_row(str(q), str(lo), str(hi), *extra)
    console.print(table)


def parse_time(value: str) -> int:
    """Epoch milliseconds, or an ISO 8601 time (UTC when it names no zone), as epoch ms."""
    text = value.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither epoch milliseconds nor ISO 8601",
                                 param_hint="--to-time") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return int(t.timestamp() * 1000)


@offsets.command("reset")
@click.option("--group", "-g", required=True, help="Consumer group.")
@click.option("--topic", "-t", required=True, help="Topic.")
@click.option("--to-offset", type=WIRE_INT, default=None, help="Move to this offset.")
@click.option("--to-time", default=None, metavar="TIME",
              help="Move to the first message stored at or after TIME (ISO 8601, UTC when "
                   "no zone is given, or epoch milliseconds).")
@click.option("--queue", "-q", type=OFFSET, default=None,
              help="Only this queue (default: every queue of the topic).")
@click.option("--force", is_flag=True,
              help="Reset even while the group has live members: they drop those queues "
                   "and read again from the new offsets.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@broker_option
@async_command
async def offsets_reset(group: str, topic: str, to_offset: int | None, to_time: str | None,
                        queue: int | None, force: bool, as_json: bool, broker: str) -> None:
    """Move GROUP's committed offsets on TOPIC; clamped to each queue's [min, max].

    Refused while the group has live members unless --force."""
    if (to_offset is None) == (to_time is None):
        raise click.UsageError("give exactly one of --to-offset and --to-time")
    ts = parse_time(to_time) if to_time is not None else None
    async with Admin(broker) as admin:
        rows = await admin.reset_offsets(group, topic, to_offset=to_offset, to_time_ms=ts,
                                         queue=queue, force=force)
    if as_json:
        out: list[dict[str, Any]] = [{"queue": r.queue_id, "old": r.old_offset,
                                      "new": r.new_offset} for r in rows]
        click.echo(json.dumps({"group": group, "topic": topic, "queues": out}))
        return
    table = Table("queue", "old offset", "new offset")
    for r in rows:
        table.add_row(str(r.queue_id), "-" if r.old_offset is None else str(r.old_offset),
                      str(r.new_offset))
    console.print(table)
