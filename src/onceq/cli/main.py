"""The ``onceq`` command."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import signal
import sys

import click
from rich.console import Console
from rich.table import Table

from ..client.admin import Admin
from ..client.message import Message
from ..client.producer import Producer
from ..client.pull import PullConsumer
from ..protocol.codes import PullStatus
from .common import COUNT, OFFSET, async_command, broker_option, fail
from .logs import log_options, setup_cli_logging

console = Console()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="onceq")
@log_options
def main(**log: str | None) -> None:
    """onceq: a message bus that ends repeated consumption."""
    setup_cli_logging(log)
    # `kill -USR1 PID` prints every thread's stack to stderr (a process that seems stuck);
    # not where there is no real stderr (the command run inside a test's runner)
    with contextlib.suppress(AttributeError, ValueError, OSError, RuntimeError):
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


# ---------------------------------------------------------------- broker
@main.group()
def broker() -> None:
    """Run a broker."""


# ---------------------------------------------------------------- topics
@main.group()
def topic() -> None:
    """Create, list and delete topics."""


@topic.command("create")
@click.argument("name")
@click.option("--queues", "-q", default=8, show_default=True, type=click.IntRange(1, 1024))
@click.option("--groups", default=None, metavar="G1,G2,...",
              help="In a cluster: spread the queues evenly over these broker groups only.")
@click.option("--placement", default=None, metavar="G,G,...",
              help="In a cluster: the broker group of each queue, in queue order.")
@broker_option
@async_command
async def topic_create(name: str, queues: int, groups: str | None, placement: str | None,
                       broker: str) -> None:
    """Create topic NAME (or grow its queue count)."""
    if groups is not None and placement is not None:
        raise click.UsageError("give --groups or --placement, not both")
    split = [g.strip() for g in (placement or "").split(",") if g.strip()] or None
    if split is not None and len(split) != queues:
        raise click.UsageError(f"--placement names {len(split)} groups for {queues} queues")
    async with Admin(broker) as admin:
        t = await admin.create_topic(
            name, queues, placement=split,
            groups=None if groups is None else [g.strip() for g in groups.split(",")
                                                if g.strip()])
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
@click.option("--queue", "-q", "queues", multiple=True, type=OFFSET, help="Queue(s); default all.")
@click.option("--offset", default=None, type=OFFSET, help="Start offset (default: queue minimum).")
@click.option("--max", "max_msgs", default=100, show_default=True, type=COUNT)
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


from .admin_cmds import register as register_admin  # noqa: E402 - status, message, trace
from .audit_cmd import register as register_audit  # noqa: E402 - audit (Spark)
from .broker_start import make_start_command  # noqa: E402 - broker start
from .cluster_cmd import register as register_cluster  # noqa: E402 - cluster status
from .console_cmd import register as register_console  # noqa: E402 - the web console
from .consumer_cmds import register  # noqa: E402 - consume, group, dlq
from .dedup_cmd import register as register_dedup  # noqa: E402 - dedup show/stats/purge
from .demo.command import demo  # noqa: E402 - the main job
from .offsets_cmds import offsets  # noqa: E402 - offsets show/reset
from .pipeline_cmd import pipeline  # noqa: E402 - the Spark pipeline
from .request_cmd import register as register_request  # noqa: E402 - request (RPC)
from .rocketmq_cmd import register as register_rocketmq  # noqa: E402 - rocketmq group
from .security_cmds import register as register_security  # noqa: E402 - user, acl, tls
from .verify_cmd import register as register_verify  # noqa: E402 - broker verify/status

register(main)
register_admin(main)
register_audit(main)
register_cluster(main)
register_dedup(main)
register_security(main)
register_console(main)
register_request(main)
register_rocketmq(main)
main.add_command(offsets)
main.add_command(demo)
main.add_command(pipeline)
register_verify(broker)
broker.add_command(make_start_command())

if __name__ == "__main__":
    main()
