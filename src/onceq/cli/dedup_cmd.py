"""``onceq dedup``: look at and clean a consumer dedup store."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import click

from ..idempotency import DedupStore, StoreError, open_store
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
    """The record of KEY: status, owner, attempt, lease and times (UTC)."""
    rec = _run(url, lambda s: s.get(group, topic, key))
    if rec is None:
        fail(f"no record for {group}/{topic}/{key} (never claimed, released or purged)")
    fields: dict[str, Any] = {
        "group": rec.group, "topic": rec.topic, "key": rec.key, "status": rec.status.value,
        "owner": rec.owner, "attempt": rec.attempt, "lease_until": _when(rec.lease_until),
        "payload_hash": rec.payload_hash, "created_at": _when(rec.created_at),
        "updated_at": _when(rec.updated_at), "expires_at": _when(rec.expires_at)}
    if as_json:
        click.echo(json.dumps(fields))
        return
    for k, v in fields.items():
        click.echo(f"{k:13} {v}")


@dedup.command("stats")
@store_option
def stats(url: str) -> None:
    """Records CONSUMING and CONSUMED (within retention)."""
    s = _run(url, lambda st: st.stats())
    click.echo(json.dumps({"consuming": s.consuming, "consumed": s.consumed}))


@dedup.command("purge")
@store_option
@click.option("--batch", default=1000, show_default=True, type=click.IntRange(1),
              help="Records removed per round.")
@click.option("--max-rounds", default=1000, show_default=True, type=click.IntRange(1))
def purge(url: str, batch: int, max_rounds: int) -> None:
    """Remove the records past their retention, in bounded batches."""
    async def go(store: DedupStore) -> int:
        total = 0
        for _ in range(max_rounds):
            n = await store.purge_expired(batch)
            total += n
            if n < batch:
                break
        return total

    click.echo(f"purged {_run(url, go)} expired record(s)")


def register(main: click.Group) -> None:
    main.add_command(dedup)
