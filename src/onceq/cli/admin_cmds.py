"""Admin commands in the shape of RocketMQ's mqadmin: ``topic status``, ``message show``,
``group trace``, ``group reset-offsets`` and ``group delete`` (tables by default,
``--json`` for scripts)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..client.admin import Admin
from ..protocol.errors import ErrorCode, OnceqError
from .common import async_command, broker_option, fail
from .offsets_cmds import offsets_reset, parse_time

console = Console()
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


def iso_ms(ms: int | None) -> str:
    """Epoch milliseconds as ISO 8601 UTC ("-" for None)."""
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


# ---------------------------------------------------------------- topic status
@click.command("status")
@click.argument("topic_name", metavar="TOPIC")
@json_option
@broker_option
@async_command
async def topic_status(topic_name: str, as_json: bool, broker: str) -> None:
    """Queues of TOPIC: min and max offsets, messages, last store time (UTC); for a topic
    whose queues follow a group, the queues read and written and what is draining."""
    async with Admin(broker) as admin:
        queues = await admin.topic_status(topic_name)
        scaling = await admin.topic_scaling(topic_name)
    if as_json:
        click.echo(json.dumps({"topic": topic_name, "queues": queues, "scaling": scaling}))
        return
    table = Table("queue", "min offset", "max offset", "messages", "first store time",
                  "last store time", title=f"topic {topic_name}")
    for q in queues:
        table.add_row(str(q["queue"]), str(q["min"]), str(q["max"]), str(q["max"] - q["min"]),
                      iso_ms(q["first_store_ms"]), iso_ms(q["last_store_ms"]))
    console.print(table)
    console.print(f"{sum(q['max'] - q['min'] for q in queues)} message(s) in "
                  f"{len(queues)} queue(s)")
    if scaling is not None:
        print_scaling(scaling)


def print_scaling(s: dict[str, Any]) -> None:
    """The queue scaling of a topic, as ``topic status`` and ``topic follow`` show it."""
    who = (f"follows group {s['group']} ({s['members']} member(s))" if s["group"]
           else "follows no group (counts frozen)")
    grace = f"; old write count usable {s['grace_left_s']:.1f}s more" if s[
        "grace_left_s"] else ""
    console.print(Text(f"{who}, {s['min']}..{s['max']} queues: reads {s['read']}, writes "
                       f"{s['write']}{grace}; key order across changes: "
                       f"{'kept' if s['key_order'] else 'per queue only'}"))
    for d in s["draining"]:
        end = "(grace)" if d["end"] is None else d["end"]
        console.print(Text(f"  draining queue {d['queue']} to {end}: waiting for "
                           f"{', '.join(d['waiting']) or 'nobody'}"))
    for g in s["gates"]:
        parents = ", ".join(f"{p['queue']}@{'(grace)' if p['end'] is None else p['end']}"
                            + (f" [{', '.join(p['waiting'])}]" if p["waiting"] else "")
                            for p in g["parents"])
        console.print(Text(f"  queue {g['queue']} read up to {g['start']} until consumed: "
                           f"{parents}"))


@click.command("follow")
@click.argument("topic_name", metavar="TOPIC")
@click.option("--group", "-g", default=None,
              help="The consumer group whose size the queue counts follow.")
@click.option("--off", is_flag=True, help="Follow no group: the counts stay as they are.")
@click.option("--min-queues", default=1, show_default=True, type=click.IntRange(1, 1024))
@click.option("--max-queues", default=None, type=click.IntRange(1, 1024),
              help="[default: the topic's queue count]")
@click.option("--queues", "-q", default=None, type=click.IntRange(1, 1024),
              help="Queues of a topic created by this command [default: --min-queues].")
@click.option("--key-order/--no-key-order", default=True, show_default=True,
              help="A queue that receives moved keys waits until the queues they left are "
                   "consumed (else key order holds per queue only).")
@json_option
@broker_option
@async_command
async def topic_follow(topic_name: str, group: str | None, off: bool, min_queues: int,
                       max_queues: int | None, queues: int | None, key_order: bool,
                       as_json: bool, broker: str) -> None:
    """Make TOPIC's read and write queue counts follow a consumer group's size (created
    when missing): a power of two at least the group's member count, within
    --min-queues..--max-queues. Queues grow for writing at once and leave reading only
    once every reading group has consumed them (docs/queue_scaling.md)."""
    if (group is None) == (not off):
        raise click.UsageError("give exactly one of --group and --off")
    async with Admin(broker) as admin:
        await admin.follow_group(topic_name, group, min_queues=min_queues,
                                 max_queues=max_queues, queues=queues, key_order=key_order)
        scaling = await admin.topic_scaling(topic_name)
    if as_json:
        click.echo(json.dumps({"topic": topic_name, "scaling": scaling}))
    elif scaling is not None:
        console.print(f"topic {topic_name}:")
        print_scaling(scaling)


# ---------------------------------------------------------------- message show
@click.group("message")
def message() -> None:
    """Find messages by unique key or business key."""


async def _consumed_by(admin: Admin, topic: str, queue: int, offset: int
                       ) -> list[dict[str, Any]]:
    """Every (non-internal) group with a committed offset on the message's queue, and
    whether that offset is past the message (the group consumed it)."""
    out = []
    for group in await admin.list_groups():
        if group.startswith("%"):
            continue
        committed = await admin.group_offset(group, topic, queue)
        if committed is not None:
            out.append({"group": group, "committed": committed, "consumed": committed > offset})
    return out


async def _dedup_records(url: str, groups: list[str], topic: str, keys: list[str]
                         ) -> list[dict[str, Any]]:
    """The idempotency layer's records of the message (by unique key or business key)."""
    from ..idempotency import StoreError, find_records

    try:
        records = await find_records(url, groups, topic, keys)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--dedup-store") from None
    except StoreError as exc:
        fail(f"dedup store: {exc}")
    return [{"group": rec.group, "key": rec.key, "status": rec.status.value,
             "owner": rec.owner, "attempt": rec.attempt,
             "updated_at": iso_ms(int(rec.updated_at * 1000)),
             "expires_at": iso_ms(int(rec.expires_at * 1000))} for rec in records]


@message.command("show")
@click.option("--topic", "-t", required=True, help="Topic the message was sent to.")
@click.option("--unique-key", "-i", default=None, help="The message's unique key.")
@click.option("--key", "-k", default=None, help="One of the message's business keys.")
@click.option("--begin", default=None, metavar="TIME",
              help="Scan messages stored from TIME (ISO 8601 or epoch ms) [default: from the "
                   "unique key's time - 1 min; for --key: 24 hours ago].")
@click.option("--end", default=None, metavar="TIME",
              help="... up to TIME [default: unique key's time + 1 h; for --key: now].")
@click.option("--max-scan", default=None, type=click.IntRange(1, 10_000_000),
              help="Most records the broker reads [default: 1,000,000].")
@click.option("--max", "max_results", default=32, show_default=True,
              type=click.IntRange(1, 1000), help="Most messages shown.")
@click.option("--dedup-store", default=None, metavar="URL",
              help="Also show the idempotency layer's records of the message from this "
                   "store (sqlite:///path, redis://..., mysql://..., postgresql://...).")
@json_option
@broker_option
@async_command
async def message_show(topic: str, unique_key: str | None, key: str | None,
                       begin: str | None, end: str | None, max_scan: int | None,
                       max_results: int, dedup_store: str | None, as_json: bool,
                       broker: str) -> None:
    """Where a message is stored (queue, offset, store time) and which groups consumed it
    (their committed offset is past it).

    The broker scans the records stored in the time range (no key index): its cost is
    one read of each of them, bounded by --max-scan."""
    if (unique_key is None) == (key is None):
        raise click.UsageError("give exactly one of --unique-key and --key")
    by, what = ("unique", unique_key) if unique_key is not None else ("keys", key)
    assert what is not None
    async with Admin(broker) as admin:
        res = await admin.query_message(
            topic, what, by=by, begin_ms=parse_time(begin) if begin else None,
            end_ms=parse_time(end) if end else None, max_scan=max_scan,
            max_results=max_results)
        msgs = res["messages"]
        for m in msgs:
            m["store_time"] = iso_ms(m["store_ms"])
            m["consumed_by"] = await _consumed_by(admin, topic, m["queue"], m["offset"])
        if dedup_store:
            groups = sorted({g["group"] for m in msgs for g in m["consumed_by"]})
            for m in msgs:
                keys = list(dict.fromkeys([m["unique_key"], *m["keys"].split()]))
                m["dedup"] = await _dedup_records(dedup_store, groups, topic, keys)
    if as_json:
        click.echo(json.dumps({"topic": topic, "by": by, "key": what, "messages": msgs,
                               "scanned": res["scanned"], "truncated": res["truncated"]}))
        return
    table = Table("queue", "offset", "unique key", "keys", "tags", "store time",
                  "reconsume", "body bytes", "consumed by", "not yet by",
                  title=f"topic {topic}: {'unique key' if by == 'unique' else 'key'} {what}")
    for m in msgs:
        done = [g["group"] for g in m["consumed_by"] if g["consumed"]]
        todo = [f"{g['group']}@{g['committed']}" for g in m["consumed_by"] if not g["consumed"]]
        table.add_row(str(m["queue"]), str(m["offset"]), m["unique_key"], Text(m["keys"]),
                      Text(m["tags"]), m["store_time"], str(m["reconsume"]), str(m["size"]),
                      Text(", ".join(done) or "-"), Text(", ".join(todo) or "-"))
    console.print(table)
    if dedup_store:
        dt = Table("offset", "group", "key", "status", "owner", "attempt", "updated",
                   "expires", title="dedup records")
        for m in msgs:
            for r in m["dedup"]:
                dt.add_row(str(m["offset"]), Text(r["group"]), Text(r["key"]), r["status"],
                           Text(r["owner"]), str(r["attempt"]), r["updated_at"],
                           r["expires_at"])
        console.print(dt if dt.row_count else "no dedup record in the store")
    console.print(f"{len(msgs)} message(s); {res['scanned']} record(s) scanned"
                  + (" (scan limit reached: more may exist)" if res["truncated"] else ""))


# ---------------------------------------------------------------- group trace
@click.command("trace")
@click.argument("group")
@click.argument("state", required=False, type=click.Choice(["on", "off"]))
@broker_option
@async_command
async def group_trace(group: str, state: str | None, broker: str) -> None:
    """Turn GROUP's delivery trace on or off (kept across broker restarts), or show it.

    With it on, the broker records every message it delivers to the group's members (and
    their joins and leaves) in the topic %TRACE%, which `onceq audit` reads."""
    async with Admin(broker) as admin:
        on = await admin.group_trace(group, None if state is None else state == "on")
    click.echo(f"delivery trace of group {group}: {'on' if on else 'off'}")


# ---------------------------------------------------------------- group delete
@click.command("delete")
@click.argument("group")
@click.option("--cluster", "endpoints", default=None, envvar="ONCEQ_CLUSTER",
              help="etcd endpoints (etcd://host:port[,...]): delete the group on every "
                   "broker group of the cluster, instead of on --broker's.")
@click.option("--cluster-name", default="onceq", show_default=True,
              envvar="ONCEQ_CLUSTER_NAME", help="Name of the cluster in etcd.")
@json_option
@broker_option
@async_command
async def group_delete(group: str, endpoints: str | None, cluster_name: str, as_json: bool,
                       broker: str) -> None:
    """Forget GROUP's committed offsets (the group is gone from `onceq group list`).

    Refused while the group has live members (GROUP_ACTIVE: stop them first). A member
    joining later starts the group afresh, from its consume_from. The group's retry and
    dead-letter topics stay. In a cluster of several broker groups a consumer group has
    offsets on each group holding its queues: give --cluster to delete it on all."""
    if endpoints is None:
        async with Admin(broker) as admin:
            queues = {"": await admin.delete_group(group)}
    else:
        queues = await _delete_everywhere(endpoints, cluster_name, group)
    total = sum(queues.values())
    if as_json:
        doc: dict[str, Any] = {"group": group, "deleted": True, "queues": total}
        if endpoints is not None:
            doc["broker_groups"] = queues
        click.echo(json.dumps(doc))
        return
    where = "" if endpoints is None else f" on broker group(s) {', '.join(sorted(queues))}"
    click.echo(f"group {group} deleted{where}: {total} committed offset(s) forgotten")


async def _delete_everywhere(endpoints: str, cluster_name: str, group: str
                             ) -> dict[str, int]:
    """Delete ``group`` on every broker group of the cluster that knows it (queues
    forgotten per broker group), after checking that none has a live member of it."""
    from ..cluster import EtcdClient, EtcdError, read_directory

    try:
        directory = await read_directory(EtcdClient(endpoints), cluster_name)
    except (EtcdError, ValueError) as exc:
        fail(f"etcd at {endpoints}: {exc}")
    admins = {g: Admin(",".join(m)) for g, m in sorted(directory.members.items()) if m}
    try:
        knowing = []
        for name, admin in admins.items():  # first: a live member anywhere refuses it all
            try:
                live = await admin.group_members(group)  # (restored lock holders too)
            except OnceqError as exc:
                if exc.code != ErrorCode.GROUP_NOT_EXIST:
                    raise
                continue
            if live:
                raise OnceqError(ErrorCode.GROUP_ACTIVE, (
                    f"group {group!r} has {len(live)} live member(s) on broker group "
                    f"{name!r} ({', '.join(m['client'] for m in live[:5])}): stop them "
                    "first"))
            knowing.append(name)
        if not knowing:
            raise OnceqError(ErrorCode.GROUP_NOT_EXIST, (
                f"consumer group {group!r} is unknown to every broker group of cluster "
                f"{cluster_name!r} ({', '.join(admins) or 'none registered'})"))
        return {name: await admins[name].delete_group(group) for name in knowing}
    finally:
        for admin in admins.values():
            await admin.close()


def register(main: click.Group) -> None:
    main.commands["topic"].add_command(topic_status)  # type: ignore[attr-defined]
    main.commands["topic"].add_command(topic_follow)  # type: ignore[attr-defined]
    group = main.commands["group"]
    group.add_command(group_trace)  # type: ignore[attr-defined]
    group.add_command(offsets_reset, "reset-offsets")  # type: ignore[attr-defined]
    group.add_command(group_delete)  # type: ignore[attr-defined]
    main.add_command(message)
