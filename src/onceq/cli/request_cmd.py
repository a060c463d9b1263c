"""``onceq request``: send a request and print its reply (docs/request_reply.md)."""

from __future__ import annotations

import click

from ..client.message import Message
from ..client.producer import Producer
from .common import async_command, broker_option


def _properties(props: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for p in props:
        k, sep, v = p.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"property {p!r} is not K=V", param_hint="--property")
        out[k] = v
    return out


@click.command("request")
@click.argument("topic_name", metavar="TOPIC")
@click.argument("body")
@click.option("--timeout", "-t", default=3.0, show_default=True,
              type=click.FloatRange(0, min_open=True), help="Seconds to wait for the reply.")
@click.option("--keys", default="", help="Business keys, space separated (the dedup key of "
                                         "a responder keyed by them).")
@click.option("--tags", default="", help="Message tag.")
@click.option("--sharding-key", default=None, help="Send to the queue this key hashes to.")
@click.option("--property", "props", multiple=True, metavar="K=V", help="User property.")
@click.option("--verbose", "-v", is_flag=True,
              help="Print where the request was stored and the round trip first.")
@broker_option
@async_command
async def request(topic_name: str, body: str, timeout: float, keys: str, tags: str,
                  sharding_key: str | None, props: tuple[str, ...], verbose: bool,
                  broker: str) -> None:
    """Send BODY to TOPIC as a request and print the reply's body. Exit code 2 with
    REQUEST_TIMEOUT when no reply comes within the timeout (the request may still be
    carried out), 3 when the broker cannot be reached."""
    msg = Message(body.encode(), tags, keys, _properties(props))
    async with Producer(broker) as producer:
        reply = await producer.request(topic_name, msg, timeout, sharding_key=sharding_key)
    if verbose:
        click.echo(f"request {reply.request_id} {reply.unique_key} -> {reply.topic}"
                   f"[{reply.queue_id}]@{reply.offset}, reply in {reply.elapsed_s * 1000:.1f} ms",
                   err=True)
    click.echo(reply.body)  # bytes as they are


def register(main: click.Group) -> None:
    main.add_command(request)
