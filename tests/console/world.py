"""A real in-process broker (with its metrics endpoint) holding real data, and the
console's app in front of it: what the console tests run against."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest

from onceq import Admin, Message, Producer, PullConsumer
from onceq.console import ConsoleConfig, create_app
from onceq.protocol.requests import SendBack
from tests.helpers import running_broker

TOPIC = "orders"
QUEUES = 4
SENT = 40  # messages of TOPIC, order-0 .. order-39, ten per queue
GROUP = "billing"  # committed 5 of each queue's 10: lag 20
TRACED = "audited"  # delivery trace on; queue 0 delivered twice: 10 duplicates
DEAD = 2  # dead letters of GROUP (queue 1, offsets 0 and 1)


@dataclass
class World:
    addr: str
    metrics_url: str
    keys: dict[str, str] = field(default_factory=dict)  # business key -> unique key


async def seed(addr: str) -> World:
    world = World(addr, "")
    async with Admin(addr) as admin:
        await admin.create_topic(TOPIC, QUEUES)
        async with Producer(addr) as p:
            for i in range(SENT):
                r = await p.send(TOPIC, Message(f'{{"order": {i}}}'.encode(), tags="created",
                                                keys=f"order-{i}"), queue=i % QUEUES)
                world.keys[f"order-{i}"] = r.unique_key
        async with PullConsumer(addr, GROUP, client_id="seed-billing") as c:
            for q in range(QUEUES):
                await c.commit_offset(TOPIC, q, 5)
        for off in range(DEAD):  # failed for good: max_reconsume 0 dead-letters it
            await admin._call(SendBack(GROUP, TOPIC, 1, off, max_reconsume=0,
                                       dlq_reason=f"bad order {off}"))
        await admin.reset_offsets(TRACED, TOPIC, to_offset=0)  # the broker knows the group
        await admin.group_trace(TRACED, True)
        async with PullConsumer(addr, TRACED, client_id="audit-a") as c:
            for _ in range(2):  # the same copies twice, never committed: duplicates
                await c.pull(TOPIC, 0, 0, 32)
    return world


@pytest.fixture
async def world(tmp_path) -> AsyncIterator[World]:
    async with running_broker(str(tmp_path / "data"), metrics_port=0) as b:
        w = await seed(f"127.0.0.1:{b.port}")
        assert b.metrics is not None
        w.metrics_url = f"http://127.0.0.1:{b.metrics.port}/metrics"
        yield w


def console_client(config: ConsoleConfig) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(config)),
                             base_url="http://127.0.0.1:8080")


@pytest.fixture
async def web(world: World) -> AsyncIterator[httpx.AsyncClient]:
    async with console_client(ConsoleConfig(broker=world.addr, metrics_url=world.metrics_url,
                                            refresh_ms=500)) as c:
        yield c


def token(html: str) -> str:
    m = re.search(r'name="token" value="([^"]+)"', html)
    assert m, "no form token on the page"
    return m.group(1)


def text_of(html: str) -> str:
    """The page's text: tags dropped, whitespace folded."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).replace("&#39;", "'")
