"""``onceq dedup``: look at and clean a consumer dedup store."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import click

from ..idempotency import DedupStore, StoreError, events, open_store
from .common import fail

T = TypeVar("T")

store_option = click.option(
    "--store", "-s", "url", required=True, envvar="ONCEQ_DEDUP_STORE",
    help="Dedup store URL: sqlite:///path, redis://host:port/db, mysql://user@host/db, "
         "postgresql://user@host/db (add ?table=NAME or ?prefix=TEXT).")


def _run(url: str, fn: Callable[[DedupStore], Awaitable[T]]) -> T:
    async def go() -> T:
        store = open_store(url)
        try:
            return await fn(store)
        finally:
            await store.close()

    try:
        return asyncio.run(go())
    except StoreError as exc:
        fail(str(exc))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90s``, ``15m``, ``12h``, ``30d`` (or a plain number of seconds) -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise ValueError(f"invalid duration {text!r}: use e.g. 90s, 15m, 12h or 30d")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")


@click.group("dedup")
def dedup() -> None:
    """Inspect and clean the dedup records of idempotent consumers."""


@dedup.command("init")
@store_option
def init(url: str) -> None:
    """Create the dedup table (SQL stores) or check that the store answers (Redis).

    Stores also create their table on first use; this lets an operator do it ahead, with
    the rights the consumers may not have."""
    s = _run(url, lambda st: st.stats())
    click.echo(f"ready: {s.consuming} CONSUMING, {s.consumed} CONSUMED")


@dedup.command("show")
@store_option
@click.option("--group", "-g", required=True, help="Consumer group.")
@click.option("--topic", "-t", required=True)
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print the record as JSON.")
def show(url: str, group: str, topic: str, key: str, as_json: bool) -> None:
    """The record of KEY: status, owner, attempt, lease and times (UTC), and its history:
    who claimed it when, with which attempt, and what happened since (claimed, extended,
    completed, released, taken-over, fenced-off), oldest first."""
    rec = _run(url, lambda s: s.get(group, topic, key))
    if rec is None:
        fail(f"no record for {group}/{topic}/{key} (never claimed, or purged)")
    fields: dict[str, Any] = {
        "group": rec.group, "topic": rec.topic, "key": rec.key, "status": rec.status.value,
        "owner": rec.owner, "attempt": rec.attempt, "lease_until": _when(rec.lease_until),
        "payload_hash": rec.payload_hash, "created_at": _when(rec.created_at),
        "updated_at": _when(rec.updated_at), "expires_at": _when(rec.expires_at)}
    history = [{"at": _when(e.at), "event": e.event, "attempt": e.attempt, "owner": e.owner}
               for e in events(rec)]
    if as_json:
        click.echo(json.dumps({**fields, "history": history}))
        return
    for k, v in fields.items():
        click.echo(f"{k:13} {v}")
    click.echo("history")
    for e in history:
        click.echo(f"  {e['at']}  {e['event']:10}  attempt {e['attempt']}  {e['owner']}")


@dedup.command("stats")
@store_option
def stats(url: str) -> None:
    """Records CONSUMING and CONSUMED (within retention)."""
    s = _run(url, lambda st: st.stats())
    click.echo(json.dumps({"consuming": s.consuming, "consumed": s.consumed,
                           "released": s.released}))


@dedup.command("purge")
@store_option
@click.option("--batch", default=1000, show_default=True, type=click.IntRange(1),
              help="Records removed per round.")
@click.option("--max-rounds", default=1000, show_default=True, type=click.IntRange(1))
@click.option("--older-than", "older_than", default=None, metavar="DURATION",
              help="Also remove records of any status last changed longer ago than this "
                   "(e.g. 90m, 12h, 30d). Removing a CONSUMED record lets a later copy of "
                   "its message run again: keep it longer than the redelivery horizon.")
def purge(url: str, batch: int, max_rounds: int, older_than: str | None) -> None:
    """Remove the records past their retention (and, with --older-than, the records not
    changed for that long), in bounded batches."""
    before = 0.0
    if older_than is not None:
        try:
            before = time.time() - parse_duration(older_than)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--older-than") from None

    async def go(store: DedupStore) -> int:
        total = 0
        for _ in range(max_rounds):
            n = await store.purge_expired(batch, before)
            total += n
            if n < batch:
                break
        return total

    what = "expired" if older_than is None else f"expired or older than {older_than}"
    click.echo(f"purged {_run(url, go)} {what} record(s)")


def register(main: click.Group) -> None:
    main.add_command(dedup)
