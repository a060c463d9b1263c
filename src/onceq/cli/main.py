"""The ``onceq`` command."""

from __future__ import annotations

import asyncio
import logging
import time

import click
from rich.console import Console
from rich.table import Table

from ..broker.config import BrokerConfig
from ..client.admin import Admin
from ..client.message import Message
from ..client.producer import Producer
from ..client.pull import PullConsumer
from ..protocol.codes import PullStatus
from ..storage.config import StoreConfig
from .common import async_command, broker_option, fail

console = Console()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="onceq")
def main() -> None:
    """onceq: a message bus that ends repeated consumption."""


# ---------------------------------------------------------------- broker
@main.group()
def broker() -> None:
    """Run a broker."""


@broker.command("start")
@click.option("--data-dir", "-d", required=True, type=click.Path(file_okay=False),
              help="Directory of the commit log, indexes and state.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", "-p", default=9876, show_default=True, type=click.IntRange(0, 65535))
@click.option("--flush", type=click.Choice(["async", "sync"]), default="async",
              show_default=True, help="sync: acknowledge a send only after fsync.")
@click.option("--flush-interval-ms", default=500, show_default=True, type=click.IntRange(1))
@click.option("--segment-size", default=1024 ** 3, show_default=True, type=click.IntRange(65536),
              help="Commit-log segment size in bytes.")
@click.option("--max-body", default=4 * 1024 * 1024, show_default=True, type=click.IntRange(1))
@click.option("--retention-hours", default=72.0, show_default=True, type=click.FloatRange(0))
@click.option("--retention-bytes", default=0, show_default=True, type=click.IntRange(0),
              help="Delete the oldest segments above this total (0: no limit).")
@click.option("--dedup-window", default=120.0, show_default=True, type=click.FloatRange(0),
              help="Seconds during which a retried send is recognised (0: off).")
@click.option("--disk-max-used-ratio", default=0.90, show_default=True,
              type=click.FloatRange(0, 1, min_open=True),
              help="Refuse writes with DISK_FULL while the data directory's file system is "
                   "used above this ratio (1: only when it is full).")
@click.option("--max-open-files", default=0, show_default=True, type=click.IntRange(0),
              help="Index files and older commit-log segments kept open at once (0: a "
                   "quarter of the process's file-descriptor limit).")
@click.option("--dedup-max-keys", default=2_000_000, show_default=True, type=click.IntRange(0),
              help="Most unique keys the dedup window holds (about 90 MB per million); above it "
                   "the oldest are forgotten early and a warning is logged (0: off).")
@click.option("--auto-create-topics/--no-auto-create-topics", default=False, show_default=True)
@click.option("--access-lock/--no-access-lock", default=True, show_default=True,
              help="Transition-state queue lock for CLUSTERING groups.")
@click.option("--access-lock-restore-hold", default=20.0, show_default=True,
              type=click.FloatRange(0, min_open=True),
              help="Seconds after start during which a holder saved before a restart keeps "
                   "its queues unless it re-asserts or gives them up first.")
@click.option("--delay-levels", default=None,
              help="Retry delay levels, e.g. '1s 5s 10s 30s 1m ...' (default RocketMQ's).")
@click.option("--max-output-bytes", default=64 * 1024 * 1024, show_default=True,
              type=click.IntRange(1),
              help="Bytes queued for one client (answers, held pulls answered, pushes) above "
                   "which it is disconnected as a slow consumer.")
@click.option("--read-timeout", default=30.0, show_default=True, type=click.FloatRange(0),
              help="Seconds within which a frame once started must be complete (0: off).")
@click.option("--idle-timeout", default=300.0, show_default=True, type=click.FloatRange(0),
              help="Seconds after which a connection that sends nothing and waits for no "
                   "held pull is closed (0: off).")
@click.option("--max-connections", default=0, show_default=True, type=click.IntRange(0),
              help="Most client connections (0: as many as the fd limit allows, less the "
                   "reserve).")
@click.option("--fd-reserve", default=128, show_default=True, type=click.IntRange(16),
              help="File descriptors always left free for the broker's own files.")
@click.option("--max-input-buffer-bytes", default=0, show_default=True,
              type=click.IntRange(0),
              help="Bytes of incomplete frames buffered for all connections together; "
                   "above, connections adding to it wait (0: the larger of 256 MiB and "
                   "four frames of the largest size).")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]))
def broker_start(data_dir: str, host: str, port: int, flush: str, flush_interval_ms: int,
                 segment_size: int, max_body: int, retention_hours: float,
                 retention_bytes: int, dedup_window: float, dedup_max_keys: int,
                 disk_max_used_ratio: float, max_open_files: int, auto_create_topics: bool,
                 access_lock: bool, access_lock_restore_hold: float, delay_levels: str | None,
                 max_output_bytes: int, read_timeout: float, idle_timeout: float,
                 max_connections: int, fd_reserve: int, max_input_buffer_bytes: int,
                 log_level: str) -> None:
    """Start a broker in the foreground (SIGTERM or Ctrl-C flushes and stops it)."""
    from ..broker.server import run

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    store = StoreConfig(data_dir, segment_size=segment_size, flush=flush,
                        flush_interval_ms=flush_interval_ms, max_body=max_body,
                        retention_hours=retention_hours, retention_bytes=retention_bytes,
                        dedup_window_s=dedup_window, dedup_max_keys=dedup_max_keys,
                        disk_max_used_ratio=disk_max_used_ratio, max_open_files=max_open_files)
    cfg = BrokerConfig(store, host=host, port=port, auto_create_topics=auto_create_topics,
                       access_lock=access_lock,
                       access_lock_restore_hold_s=access_lock_restore_hold,
                       max_output_bytes=max_output_bytes, read_timeout_s=read_timeout,
                       idle_timeout_s=idle_timeout, max_connections=max_connections,
                       fd_reserve=fd_reserve, max_input_buffer_bytes=max_input_buffer_bytes)
    if delay_levels is not None:
        cfg.delay_levels = delay_levels
    try:
        cfg.validate()
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None

    def ready(b: object) -> None:
        click.echo(f"onceq broker listening on {host}:{b.port} (data {data_dir}, flush {flush})",
                   err=True)

    try:
        run(cfg, ready)
    except OSError as exc:
        raise click.ClickException(f"cannot start broker: {exc}") from None


# ---------------------------------------------------------------- topics
@main.group()
def topic() -> None:
    """Create, list and delete topics."""


@topic.command("create")
@click.argument("name")
@click.option("--queues", "-q", default=8, show_default=True, type=click.IntRange(1, 1024))
@broker_option
@async_command
async def topic_create(name: str, queues: int, broker: str) -> None:
    """Create topic NAME (or grow its queue count)."""
    async with Admin(broker) as admin:
        t = await admin.create_topic(name, queues)
    click.echo(f"topic {t['topic']}: {t['queues']} queues")


@topic.command("list")
@broker_option
@async_command
async def topic_list(broker: str) -> None:
    """List topics with queue counts and message counts."""
    async with Admin(broker) as admin:
        topics = await admin.list_topics()
        table = Table("topic", "queues", "messages")
        for t in topics:
            offs = await admin.topic_offsets(t["topic"])
            table.add_row(t["topic"], str(t["queues"]), str(sum(hi - lo for lo, hi in offs)))
    console.print(table)


@topic.command("delete")
@click.argument("name")
@broker_option
@async_command
async def topic_delete(name: str, broker: str) -> None:
    """Delete topic NAME and its indexes."""
    async with Admin(broker) as admin:
        await admin.delete_topic(name)
    click.echo(f"topic {name} deleted")


# ---------------------------------------------------------------- send / pull
@main.command()
@click.argument("topic_name", metavar="TOPIC")
@click.argument("body")
@click.option("--tags", default="", help="Message tag.")
@click.option("--keys", default="", help="Business keys, space separated.")
@click.option("--sharding-key", default=None, help="Send to the queue this key hashes to.")
@click.option("--property", "props", multiple=True, metavar="K=V", help="User property.")
@click.option("--count", "-n", default=1, show_default=True, type=click.IntRange(1))
@broker_option
@async_command
async def send(topic_name: str, body: str, tags: str, keys: str, sharding_key: str | None,
               props: tuple[str, ...], count: int, broker: str) -> None:
    """Send BODY to TOPIC (COUNT times)."""
    properties = {}
    for p in props:
        k, sep, v = p.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"property {p!r} is not K=V", param_hint="--property")
        properties[k] = v
    async with Producer(broker) as producer:
        for _ in range(count):
            r = await producer.send(
                topic_name, Message(body.encode(), tags, keys, properties),
                sharding_key=sharding_key)
            click.echo(f"sent {r.unique_key} -> {r.topic}[{r.queue_id}]@{r.offset}"
                       + (" (duplicate)" if r.duplicate else ""))


@main.command()
@click.argument("topic_name", metavar="TOPIC")
@click.option("--queue", "-q", "queues", multiple=True, type=int, help="Queue(s); default all.")
@click.option("--offset", default=None, type=int, help="Start offset (default: queue minimum).")
@click.option("--max", "max_msgs", default=100, show_default=True, type=click.IntRange(1))
@click.option("--tags", default=None, help="Tag expression, e.g. 'A || B'.")
@click.option("--follow", "-f", is_flag=True, help="Keep waiting for new messages (tail).")
@broker_option
@async_command
async def pull(topic_name: str, queues: tuple[int, ...], offset: int | None, max_msgs: int,
               tags: str | None, follow: bool, broker: str) -> None:
    """Print messages of TOPIC."""
    async with PullConsumer(broker, "onceq-cli") as c:
        qs = list(queues) or list(range(await c.queue_count(topic_name)))
        nxt = {}
        for q in qs:
            lo, _ = await c.queue_offsets(topic_name, q)
            nxt[q] = lo if offset is None else offset
        printed = 0
        while True:
            idle = True
            for q in qs:
                r = await c.pull(topic_name, q, nxt[q], min(max_msgs - printed, 256) or 1,
                                 tags=tags, suspend=0.5 if follow and len(qs) == 1 else 0)
                if r.status == PullStatus.OFFSET_ILLEGAL:
                    fail(f"offset {nxt[q]} is beyond the end of queue {q} ({r.max_offset})")
                if r.status == PullStatus.DAMAGED:
                    click.echo(f"{topic_name}[{q}]@{nxt[q]}..{r.next_offset - 1}: lost to disk "
                               "damage, skipped", err=True)
                if r.next_offset != nxt[q]:
                    idle = False  # moved on (maybe past messages the tags filtered out)
                nxt[q] = r.next_offset
                for m in r.messages:
                    idle = False
                    click.echo(f"{m.topic}[{m.queue_id}]@{m.queue_offset} key={m.unique_key} "
                               f"tags={m.tags!r} {m.body.decode(errors='replace')}")
                    printed += 1
                if not follow and printed >= max_msgs:
                    return
            if idle:
                if not follow:
                    return
                await asyncio.sleep(0.2)


@main.command()
@click.option("--messages", "-n", default=5000, show_default=True, type=click.IntRange(1))
@click.option("--queues", default=8, show_default=True, type=click.IntRange(1, 1024))
def demo(messages: int, queues: int) -> None:
    """Run an embedded broker in a temp dir, produce and consume, and report."""
    from .demo import run_demo

    t0 = time.perf_counter()
    ok = asyncio.run(run_demo(messages, queues, console))
    console.print(f"demo finished in {time.perf_counter() - t0:.1f}s")
    raise SystemExit(0 if ok else 1)


from .consumer_cmds import register  # noqa: E402 - consume, group, dlq
from .dedup_cmd import register as register_dedup  # noqa: E402 - dedup show/stats/purge
from .offsets_cmds import offsets  # noqa: E402 - offsets show/reset
from .verify_cmd import register as register_verify  # noqa: E402 - broker verify/status

register(main)
register_dedup(main)
main.add_command(offsets)
register_verify(broker)

if __name__ == "__main__":
    main()
