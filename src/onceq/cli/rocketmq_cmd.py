"""``onceq rocketmq group``: the settings of consumer groups of RocketMQ clients (FIFO, max
delivery attempts, retry delays), kept in ``rocketmq_groups.json`` in the broker's data
directory (``rocketmq/groups.py``).

The commands write the file of a stopped or running broker (atomically, as the broker
writes its own files); a running broker takes a change within a second. The clients read
their group's mode when they start: restart a group's consumers after marking it FIFO.
"""

from __future__ import annotations

import json
import re

import click
from rich.console import Console
from rich.table import Table

from ..rocketmq.groups import DEFAULT_MAX_ATTEMPTS, MAX_ATTEMPTS, MAX_INVISIBLE_S
from .common import fail

console = Console()
DEFAULTS = (f"not FIFO, {DEFAULT_MAX_ATTEMPTS} delivery attempts, the clients' retry "
            "delays")

_UNIT_S = {"s": 1, "m": 60, "h": 3600}
_DELAY = re.compile(r"(\d+)(s|m|h)?", re.ASCII)

_DATA_DIR = click.option("--data-dir", required=True,
                         type=click.Path(file_okay=False, exists=True),
                         help="The broker's data directory (its rocketmq_groups.json).")


def _check_group(name: str) -> str:
    from ..storage.errors import InvalidName
    from ..storage.topics import check_name

    try:
        return check_name("group", name)
    except InvalidName as exc:
        fail(str(exc))


def _retry_delays(spec: str) -> str:
    """``1,5,10`` (seconds; ``30s``, ``5m``, ``2h`` too) in the file's notation
    (``1s 5s 10s``); ``none`` -> ``""`` (the clients' own)."""
    if spec.strip().lower() == "none":
        return ""
    items = [t for t in re.split(r"[,\s]+", spec.strip()) if t]
    if not items:
        fail("--retry-delays needs at least one delay, like 1,5,10 (seconds), or none")
    out = []
    for item in items:
        m = _DELAY.fullmatch(item)
        if m is None:
            fail(f"--retry-delays: bad delay {item!r}: give whole seconds like 1,5,10 "
                 "(or 30s, 5m, 2h), or none")
        seconds = int(m.group(1)) * _UNIT_S[m.group(2) or "s"]
        if not 1 <= seconds <= MAX_INVISIBLE_S:
            fail(f"--retry-delays: delay {item!r} is out of range: each is 1s to 12h")
        out.append(f"{seconds}s")
    return " ".join(out)


def _load(data_dir: str) -> dict[str, dict[str, object]]:
    from ..rocketmq.groups import load

    try:
        return load(data_dir)
    except (OSError, ValueError) as exc:
        fail(f"cannot read the RocketMQ group settings: {exc} (fix or remove the file)")


def _save(data_dir: str, groups: dict[str, dict[str, object]]) -> None:
    from ..rocketmq.groups import save

    try:
        save(data_dir, groups)
    except (OSError, ValueError) as exc:
        fail(f"cannot write the RocketMQ group settings: {exc}")


def _describe(entry: dict[str, object]) -> dict[str, object]:
    """An entry with its defaults filled in."""
    return {"fifo": bool(entry.get("fifo", False)),
            "max_delivery_attempts": entry.get("max_delivery_attempts",
                                               DEFAULT_MAX_ATTEMPTS),
            "retry_delays": entry.get("retry_delays", "") or None}


def _line(group: str, entry: dict[str, object]) -> str:
    d = _describe(entry)
    delays = d["retry_delays"] or "the clients' own (1s)"
    return (f"group {group}: {'FIFO' if d['fifo'] else 'not FIFO'}, max delivery attempts "
            f"{d['max_delivery_attempts']}, retry delays {delays}")


@click.group()
def rocketmq() -> None:
    """Settings of the RocketMQ gRPC endpoint kept in the broker's data directory
    (docs/rocketmq.md)."""


@rocketmq.group("group")
def group() -> None:
    """Consumer groups of RocketMQ clients: FIFO, max delivery attempts, retry delays
    (rocketmq_groups.json; a running broker takes a change within a second)."""


@group.command("set")
@click.argument("name", metavar="GROUP")
@click.option("--fifo/--no-fifo", default=None,
              help="The group consumes each queue in order, one run at a time.")
@click.option("--max-delivery-attempts", type=int, default=None, metavar="N",
              help="Deliveries of a message before it goes to %DLQ%<group> "
                   f"(1..{MAX_ATTEMPTS}; default {DEFAULT_MAX_ATTEMPTS}).")
@click.option("--retry-delays", default=None, metavar="LIST",
              help="A PushConsumer's back-off, attempt 1 first, the last repeated: whole "
                   "seconds like 1,5,10 (or 30s, 5m, 2h); none for the clients' own.")
@_DATA_DIR
def group_set(name: str, fifo: bool | None, max_delivery_attempts: int | None,
              retry_delays: str | None, data_dir: str) -> None:
    """Set GROUP's settings (those not given keep their value, or the default)."""
    _check_group(name)
    if fifo is None and max_delivery_attempts is None and retry_delays is None:
        fail("nothing to set: give --fifo/--no-fifo, --max-delivery-attempts N or "
             "--retry-delays LIST")
    if max_delivery_attempts is not None and not 1 <= max_delivery_attempts <= MAX_ATTEMPTS:
        fail(f"--max-delivery-attempts must be 1..{MAX_ATTEMPTS}, not {max_delivery_attempts}")
    delays = None if retry_delays is None else _retry_delays(retry_delays)
    groups = _load(data_dir)
    entry = dict(groups.get(name, {}))
    was_fifo = bool(entry.get("fifo", False))
    if fifo is not None:
        entry["fifo"] = fifo
    if max_delivery_attempts is not None:
        entry["max_delivery_attempts"] = max_delivery_attempts
    if delays is not None:
        if delays:
            entry["retry_delays"] = delays
        else:
            entry.pop("retry_delays", None)
    groups[name] = entry
    _save(data_dir, groups)
    click.echo(_line(name, entry))
    if fifo is not None and fifo != was_fifo:
        click.echo("its consumers take the change when they start again: restart them")


@group.command("list")
@_DATA_DIR
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
def group_list(data_dir: str, as_json: bool) -> None:
    """List the groups with settings (every other group has the defaults)."""
    groups = _load(data_dir)
    if as_json:
        click.echo(json.dumps({g: _describe(e) for g, e in sorted(groups.items())},
                              indent=1))
        return
    if not groups:
        click.echo(f"no RocketMQ group settings in {data_dir}: every group has the "
                   f"defaults ({DEFAULTS})")
        return
    table = Table("group", "fifo", "max delivery attempts", "retry delays")
    for g, e in sorted(groups.items()):
        d = _describe(e)
        table.add_row(g, "yes" if d["fifo"] else "no", str(d["max_delivery_attempts"]),
                      str(d["retry_delays"] or "-"))
    console.print(table)


@group.command("delete")
@click.argument("name", metavar="GROUP")
@_DATA_DIR
def group_delete(name: str, data_dir: str) -> None:
    """Delete GROUP's settings: it has the defaults again."""
    groups = _load(data_dir)
    if groups.pop(name, None) is None:
        fail(f"group {name!r} has no RocketMQ settings in {data_dir}")
    _save(data_dir, groups)
    click.echo(f"group {name}: settings deleted, it has the defaults ({DEFAULTS})")


def register(main: click.Group) -> None:
    main.add_command(rocketmq)
