"""A broker's guard on requests naming a topic made on another broker group a moment ago
(``broker/routes.py``): every request arriving while the topic's route is read from etcd
and the topic created here waits for them, rather than answering ``TOPIC_NOT_EXIST``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from onceq.broker.routes import Routes
from onceq.cluster import GroupDirectory, TopicRoute
from onceq.cluster._etcd import KeyValue
from onceq.protocol.errors import ErrorCode, OnceqError
from onceq.protocol.requests import GetRoute, Pull, Send


class SlowEtcd:
    """``get`` of a route answers once ``gate`` is set (the read is in flight meanwhile)."""

    def __init__(self, route: TopicRoute) -> None:
        self.route = route
        self.gate = asyncio.Event()
        self.reads = 0

    async def get(self, key: bytes) -> tuple[KeyValue, int]:
        self.reads += 1
        await self.gate.wait()
        return KeyValue(key, json.dumps(self.route.to_json()).encode(), 1, 1, 1, 0), 1


class Store:
    def __init__(self) -> None:
        self.topics: dict[str, int] = {}


class Conn:
    def __init__(self) -> None:
        self.answers: dict[int, Any] = {}

    def answer(self, corr: int, reply: Any) -> None:
        self.answers[corr] = reply

    def respond(self, corr: int, code: int, details: dict[str, Any]) -> None:
        self.answers[corr] = (code, details.get("message"))


async def test_requests_during_the_routes_read_wait_for_the_topic() -> None:
    from onceq.broker.fields import Call

    store, conn = Store(), Conn()
    created: list[tuple[str, int]] = []

    async def create_local(topic: str, queues: int) -> None:
        await asyncio.sleep(0)  # the topics table written in a thread
        created.append((topic, queues))
        store.topics[topic] = queues

    etcd = SlowEtcd(TopicRoute("orders", ("g1", "g2", "g1", "g2"), 1))
    routes = Routes(store, 8, "g2", is_leader=lambda: True,  # type: ignore[arg-type]
                    create_local=create_local)
    routes.attach(etcd, "c")  # type: ignore[arg-type]
    routes.loaded = True
    routes.directory = GroupDirectory({"g1": ["h1:1"], "g2": ["h2:1"]},
                                      {"g1": "h1:1", "g2": "h2:1"})
    served: list[tuple[str, bool]] = []

    def handler(call: Call, req: Any) -> str:
        served.append((type(req).__name__, req.topic in store.topics))
        return "ok"

    guarded = routes._guarded(handler)
    assert guarded(Call(conn, 1), Send("orders", 1, b"")) is None  # the read starts
    assert guarded(Call(conn, 2), Pull("orders", 1, 0, 32)) is None  # (it waits)
    assert routes.h_get_route(Call(conn, 3), GetRoute("orders")) is None
    await asyncio.sleep(0.01)
    assert served == [] and conn.answers == {}
    etcd.gate.set()
    for _ in range(100):
        if len(conn.answers) == 3:
            break
        await asyncio.sleep(0.01)
    assert etcd.reads == 1 and created == [("orders", 4)]
    assert served == [("Send", True), ("Pull", True)]
    assert conn.answers[1] == conn.answers[2] == "ok"
    assert list(conn.answers[3].placement) == ["g1", "g2", "g1", "g2"]
    # now known: served at once, and a queue of the other group refused WRONG_GROUP
    assert guarded(Call(conn, 4), Pull("orders", 3, 0, 32)) == "ok"
    with pytest.raises(OnceqError) as err:
        guarded(Call(conn, 5), Pull("orders", 0, 0, 32))
    assert err.value.code == ErrorCode.WRONG_GROUP and etcd.reads == 1
