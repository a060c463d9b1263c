"""``onceq consume``, ``onceq group ...`` and ``onceq dlq ...``."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import datetime
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..client.admin import Admin, QueueStatus
from ..client.push import ConsumeContext, ConsumeStatus, PushConsumer
from ..client.push_config import ConsumeFrom, MessageModel
from ..log.record import MessageExt
from ..protocol.codes import (
    PROP_DLQ_REASON,
    PROP_ORIGIN_OFFSET,
    PROP_ORIGIN_QUEUE,
    PROP_ORIGIN_TOPIC,
    RETRY_PREFIX,
    dlq_topic,
)
from .common import COUNT, OFFSET, async_command, broker_option, fail, run_async
from .logs import command_log_level

console = Console()
Handler = Callable[[list[MessageExt], ConsumeContext], Any]


# ---------------------------------------------------------------- consume
def load_handler(spec: str) -> Handler:
    """``module:function`` (``function`` may be dotted) -> the callable; a usage error
    (exit 2, no traceback) when it cannot be loaded."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise click.BadParameter(f"{spec!r} is not module:function "
                                 "(e.g. myapp.handlers:on_order)", param_hint="--handler")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: modules of the current directory
    try:
        obj: Any = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if exc.name and (mod_name == exc.name or mod_name.startswith(exc.name + ".")):
            raise click.BadParameter(f"no module named {mod_name!r} (is it on PYTHONPATH?)",
                                     param_hint="--handler") from None
        raise click.BadParameter(f"importing {mod_name!r} failed: {exc}",
                                 param_hint="--handler") from None
    except Exception as exc:
        raise click.BadParameter(f"importing {mod_name!r} failed: {type(exc).__name__}: {exc}",
                                 param_hint="--handler") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise click.BadParameter(f"{mod_name!r} has no attribute {attr!r}",
                                     param_hint="--handler") from None
    if not callable(obj):
        raise click.BadParameter(f"{spec!r} is not callable", param_hint="--handler")
    return obj


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))  # noqa: B004 - an object with an async __call__


def _parse_timestamp(ctx: click.Context, param: click.Parameter, value: str | None
                     ) -> int | None:
    if value is None:
        return None
    if value.isdigit():
        return int(value)
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter("use epoch milliseconds or ISO 8601 "
                                 "(e.g. 2024-05-01T12:00:00)") from None
    return int(dt.timestamp() * 1000)


def format_message(m: MessageExt, ctx: ConsumeContext) -> str:
    """One line per message; a retry shows where it was first stored."""
    queue, offset = str(m.queue_id), str(m.queue_offset)
    if ctx.queue.topic.startswith(RETRY_PREFIX):
        queue = m.properties.get(PROP_ORIGIN_QUEUE, queue)
        offset = m.properties.get(PROP_ORIGIN_OFFSET, offset)
    return (f"{m.topic}[{queue}]@{offset} key={m.unique_key} tags={m.tags!r} "
            f"reconsume={m.reconsume_times} {m.body.decode(errors='replace')}")


@click.command()
@click.argument("topic_name", metavar="TOPIC")
@click.option("--group", "-g", required=True, help="Consumer group.")
@click.option("--tags", default="*", show_default=True, help="Tag expression, e.g. 'A || B'.")
@click.option("--handler", "handler_spec", default=None, metavar="MODULE:FUNCTION",
              help="Call this (sync or async) function(msgs, ctx) -> None | ConsumeStatus "
                   "instead of printing the messages. An exception or RECONSUME_LATER "
                   "retries the messages.")
@click.option("--from", "start_from", type=click.Choice(["first", "last", "timestamp"]),
              default=None, help="Where a group without committed offsets starts "
                                 "[default: last; timestamp with --timestamp].")
@click.option("--timestamp", default=None, callback=_parse_timestamp,
              help="Start time for --from timestamp: epoch ms or ISO 8601 "
                   "(default: 30 minutes ago).")
@click.option("--broadcast", is_flag=True,
              help="Every consumer of the group gets every message (offsets kept locally).")
@click.option("--offset-dir", default=None, type=click.Path(file_okay=False),
              help="With --broadcast: directory of the local offsets [default: ~/.onceq].")
@click.option("--count", "-n", default=None, type=click.IntRange(1),
              help="Stop after N messages (deliveries, retries included; a batch is not "
                   "split).")
@click.option("--batch-size", default=1, show_default=True, type=click.IntRange(1),
              help="Messages per handler call.")
@click.option("--concurrency", default=20, show_default=True, type=click.IntRange(1),
              help="Handler calls running at once.")
@click.option("--max-reconsume", default=16, show_default=True, type=click.IntRange(0, 10_000),
              help="Retries before a message goes to the group's dead-letter queue.")
@click.option("--orderly", is_flag=True,
              help="Each queue strictly in order, one batch at a time, under the broker's "
                   "queue lock; a handler may return ConsumeStatus.SUSPEND.")
@click.option("--log-level", default="WARNING", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]))
@broker_option
def consume(topic_name: str, group: str, tags: str, handler_spec: str | None,
            start_from: str | None, timestamp: int | None, broadcast: bool,
            offset_dir: str | None, count: int | None, batch_size: int, concurrency: int,
            max_reconsume: int, orderly: bool, log_level: str, broker: str) -> None:
    """Consume TOPIC as a member of a consumer group (push consumer).

    Prints each message (topic[queue]@offset, unique key, tags, reconsume count, body),
    or runs --handler. Stops after --count messages, or on Ctrl-C / SIGTERM: pulling stops,
    running handlers finish, offsets are committed and the member leaves the group.
    """
    handler = load_handler(handler_spec) if handler_spec else None
    if start_from is None:
        start_from = "timestamp" if timestamp is not None else "last"
    elif timestamp is not None and start_from != "timestamp":
        raise click.BadParameter("--timestamp goes with --from timestamp",
                                 param_hint="--timestamp")
    command_log_level(log_level)
    settings: dict[str, Any] = {
        "consume_from": ConsumeFrom(start_from.upper()), "consume_timestamp_ms": timestamp,
        "model": MessageModel.BROADCASTING if broadcast else MessageModel.CLUSTERING,
        "offset_dir": offset_dir, "batch_size": batch_size, "concurrency": concurrency,
        "max_reconsume": max_reconsume, "orderly": orderly,
    }
    n = run_async(_run_consumer(broker, group, topic_name, tags, handler, count, settings))
    click.echo(f"consumed {n} message(s)", err=True)


async def _run_consumer(broker: str, group: str, topic: str, tags: str,
                        handler: Handler | None, count: int | None,
                        settings: dict[str, Any]) -> int:
    async with Admin(broker) as admin:
        await admin.queue_count(topic)  # TOPIC_NOT_EXIST now rather than waiting silently
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    admitted = done = 0
    pool = None
    if handler is not None and not _is_async(handler):
        pool = ThreadPoolExecutor(settings["concurrency"], thread_name_prefix="onceq-handler")

    async def listener(msgs: list[MessageExt], ctx: ConsumeContext) -> ConsumeStatus | None:
        nonlocal admitted, done
        if count is not None and admitted >= count:
            # Past --count: end this call without a result, so the consumer neither
            # acknowledges nor retries these messages; they stay in flight, hold the
            # committed offset back and are delivered again to the next consumer.
            raise asyncio.CancelledError
        admitted += len(msgs)
        try:
            if handler is None:
                for m in msgs:
                    click.echo(format_message(m, ctx))
                result = None
            elif pool is None:
                result = await handler(msgs, ctx)
            else:
                result = await loop.run_in_executor(pool, handler, msgs, ctx)
                if inspect.isawaitable(result):
                    result = await result
        finally:
            done += len(msgs)
            if count is not None and done >= count:
                stop.set()
        if result is None or result in tuple(ConsumeStatus):
            return result
        raise TypeError(f"handler returned {result!r}: return None, ConsumeStatus.SUCCESS, "
                        "ConsumeStatus.RECONSUME_LATER or (--orderly) ConsumeStatus.SUSPEND")

    def on_signal(signum: int) -> None:
        click.echo(f"{signal.Signals(signum).name}: stopping (again to abort)", err=True)
        stop.set()
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(s)

    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, on_signal, s)
    consumer = PushConsumer(broker, group, listener, **settings)
    consumer.subscribe(topic, tags)
    try:
        try:
            await consumer.start()
        except BaseException:
            await consumer.shutdown()
            raise
        try:
            await stop.wait()
        finally:
            await consumer.shutdown()
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
    return done


# ---------------------------------------------------------------- groups
@click.group("group")
def group_cmd() -> None:
    """Inspect consumer groups."""


@group_cmd.command("list")
@click.option("--all", "show_all", is_flag=True,
              help="Include the broker's internal groups (names starting with %).")
@broker_option
@async_command
async def group_list(show_all: bool, broker: str) -> None:
    """List consumer groups (online members, or committed offsets) with their members."""
    async with Admin(broker) as admin:
        table = Table("group", "members", "model", "topics")
        for name in await admin.list_groups():
            if name.startswith("%") and not show_all:
                continue
            members = await admin.group_members(name)
            models = sorted({m.get("model", "") for m in members})
            topics = sorted({t for m in members for t in (m.get("subs") or {})})
            table.add_row(name, str(len(members)), ",".join(models) or "-",
                          Text(", ".join(topics) or "-"))
    console.print(table)


def _subs(subs: dict[str, str]) -> Text:
    return Text(", ".join(f"{t}:{e}" for t, e in sorted(subs.items())) or "-")


@group_cmd.command("status")
@click.argument("group")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@broker_option
@async_command
async def group_status(group: str, as_json: bool, broker: str) -> None:
    """Members of GROUP and, per queue of the topics they subscribe to, the broker's max
    offset, the deliver offset, the group's committed (ack) offset, the lag, the lock holder
    (access lock, or orderly lock with its age) and whether a handover is pending, and the
    member that owns the queue when the members use the default (AVERAGE) allocation."""
    async with Admin(broker) as admin:
        st = await admin.group_status(group)
    if as_json:
        click.echo(json.dumps({"group": group, "members": [asdict(m) for m in st.members],
                               "queues": [{**asdict(q), "lag": q.lag} for q in st.queues],
                               "lag": st.lag}))
        return
    if st.members:
        table = Table("client id", "model", "subscriptions", "last heartbeat (s ago)",
                      "address", title=f"group {group}: {len(st.members)} member(s)")
        for m in st.members:
            table.add_row(Text(m.client_id), m.model, _subs(m.subscriptions),
                          f"{m.heartbeat_age_s:.1f}", Text(m.peer))
        console.print(table)
    else:
        console.print(f"group {group}: no member online")
    if not st.queues:
        console.print("no queue to show (no subscribed topic, no committed offset)")
        return
    table = Table("topic", "queue", "max offset", "deliver", "committed (ack)", "lag",
                  "lock holder", "handover", "expected owner (AVERAGE)", "fuse")
    for q in st.queues:
        table.add_row(q.topic, str(q.queue_id), str(q.max_offset),
                      "-" if q.deliver_offset is None else str(q.deliver_offset),
                      "-" if q.committed is None else str(q.committed), str(q.lag),
                      Text(_holder(q)),
                      "pending" if q.handover_pending else "-",
                      Text(q.expected_owner or "-"), _fuse(q))
    console.print(table)
    console.print(f"total lag: {st.lag}")


def _fuse(q: QueueStatus) -> str:
    if q.fuse_limit is None:
        return "-"
    return f"TRIPPED (at {q.fuse_limit})" if q.fuse_tripped else f"{q.fuse_limit}"


def _holder(q: QueueStatus) -> str:
    if q.orderly_holder is not None:
        return f"{q.orderly_holder} (orderly, {q.orderly_age_s:.0f}s)"
    return q.lock_holder or "-"


# ---------------------------------------------------------------- dead letters
@click.group()
def dlq() -> None:
    """List and resend a group's dead letters (%DLQ%<group>)."""


@dlq.command("list")
@click.argument("group")
@click.option("--max", "max_msgs", default=100, show_default=True, type=COUNT)
@click.option("--start", default=None, type=OFFSET,
              help="First DLQ offset to show (default: the oldest).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@broker_option
@async_command
async def dlq_list(group: str, max_msgs: int, start: int | None, as_json: bool,
                   broker: str) -> None:
    """Print the dead letters of GROUP."""
    async with Admin(broker) as admin:
        rng = await admin.dead_letter_offsets(group)
        letters = [] if rng is None or rng[0] >= rng[1] else \
            await admin.dead_letters(group, max_msgs, start)
    if as_json:
        click.echo(json.dumps({"group": group, "topic": dlq_topic(group),
                               "min": rng[0] if rng else 0, "max": rng[1] if rng else 0,
                               "letters": [_letter(m) for m in letters]}))
        return
    if rng is None or rng[0] >= rng[1]:
        click.echo(f"group {group} has no dead letters")
        return
    table = Table("offset", "unique key", "origin topic", "origin queue@offset", "reconsume",
                  "reason", "body", title=f"{dlq_topic(group)}")
    for col in table.columns[-2:]:
        col.no_wrap = True
        col.overflow = "ellipsis"
    table.columns[-2].max_width = 40
    for m in letters:
        p = m.properties
        table.add_row(str(m.queue_offset), m.unique_key, Text(p.get(PROP_ORIGIN_TOPIC, "?")),
                      f"{p.get(PROP_ORIGIN_QUEUE, '?')}@{p.get(PROP_ORIGIN_OFFSET, '?')}",
                      str(m.reconsume_times), Text(p.get(PROP_DLQ_REASON, "")),
                      Text(m.body.decode(errors="replace")))
    console.print(table)
    console.print(f"{len(letters)} of {rng[1] - rng[0]} dead letter(s) shown "
                  f"(offsets {rng[0]}..{rng[1] - 1})")


def _letter(m: MessageExt) -> dict[str, Any]:
    p = m.properties
    return {"offset": m.queue_offset, "unique_key": m.unique_key, "keys": m.keys,
            "tags": m.tags, "origin_topic": p.get(PROP_ORIGIN_TOPIC),
            "origin_queue": p.get(PROP_ORIGIN_QUEUE), "origin_offset": p.get(PROP_ORIGIN_OFFSET),
            "reconsume": m.reconsume_times, "store_ms": m.store_ts_ms,
            "reason": p.get(PROP_DLQ_REASON),
            "body": m.body.decode(errors="replace")}


@dlq.command("resend")
@click.argument("group")
@click.option("--offset", "offsets", multiple=True, type=OFFSET,
              help="DLQ offset to resend (repeatable).")
@click.option("--all", "resend_all", is_flag=True, help="Resend every dead letter.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@broker_option
@async_command
async def dlq_resend(group: str, offsets: tuple[int, ...], resend_all: bool, as_json: bool,
                     broker: str) -> None:
    """Send dead letters of GROUP back to GROUP through its retry topic %RETRY%<GROUP>, as
    RocketMQ does: only GROUP consumes them again (the other groups of the origin topic
    already did), and its consumers see them under their origin topic.

    A resent message keeps its unique key and its reconsume count (so that the broker does
    not take it for a producer retry of the original); the same dead letter resent twice
    within the broker's dedup window is stored once. A resent message that fails again goes
    straight back to the dead-letter queue.
    """
    if bool(offsets) == resend_all:
        raise click.UsageError("give --offset O (repeatable) or --all")
    async with Admin(broker) as admin:
        results = await admin.resend_dead_letters(group, None if resend_all else offsets)
    if as_json:
        click.echo(json.dumps({"group": group, "resent": [asdict(r) for r in results]}))
        if any(r.error for r in results):
            fail(f"{sum(1 for r in results if r.error)} of {len(results)} dead letter(s) "
                 "could not be resent")
        return
    if not results:
        click.echo(f"group {group} has no dead letters")
        return
    failed = 0
    for r in results:
        src = f"{dlq_topic(group)}@{r.dlq_offset} key={r.unique_key}"
        if r.error:
            failed += 1
            click.echo(f"not resent {src}: {r.error}", err=True)
        elif r.duplicate:
            click.echo(f"resent {src} -> {r.topic}[{r.queue_id}]@{r.offset} "
                       "(duplicate: already resent)")
        else:
            click.echo(f"resent {src} -> {r.topic}[{r.queue_id}]@{r.offset}")
    if failed:
        fail(f"{failed} of {len(results)} dead letter(s) could not be resent")


def register(main: click.Group) -> None:
    for cmd in (consume, group_cmd, dlq):
        main.add_command(cmd)
