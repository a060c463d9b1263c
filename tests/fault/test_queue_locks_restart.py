"""Orderly queue locks across a broker SIGKILL: the holders keep their queues when they come
back, a member back first cannot take them meanwhile, a holder that never returns frees
its queues after the lock expiry, and a damaged lock file only costs the saved locks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from onceq import Admin
from onceq.client.connection import BrokerConnection
from onceq.protocol.codes import PullStatus, RequestCode
from tests.helpers import free_port, spawn_broker

pytestmark = pytest.mark.timeout(120)

G, T = "rg", "RT"


async def _member(addr: str, client: str) -> BrokerConnection:
    conn = await BrokerConnection.open(addr)
    await conn.request(RequestCode.HEARTBEAT, {"client": client, "groups": [
        {"group": G, "model": "CLUSTERING", "subs": {T: "*"}, "meta": {"orderly": True}}]})
    return conn


async def _lock(conn: BrokerConnection, client: str, queues: list[int]) -> list[int]:
    hdr, _ = await conn.request(RequestCode.LOCK_QUEUES, {
        "group": G, "client": client, "queues": [[T, q] for q in queues]})
    return [q for _t, q in hdr["locked"]]


async def _members(conn: BrokerConnection) -> dict[str, bool]:
    hdr, _ = await conn.request(RequestCode.LIST_GROUP_MEMBERS, {"group": G})
    return {m["client"]: bool(m.get("restored")) for m in hdr["members"]}


def _kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


async def _saved(path: str, holders: set[str], timeout: float = 10.0) -> None:
    """The broker saves its locks right after they change: wait until the file has them."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path, "rb") as f:
                if {r[3] for r in json.load(f)["orderly"]} == holders:
                    return
        except (FileNotFoundError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} never held the locks of {sorted(holders)}")
        await asyncio.sleep(0.02)


@pytest.mark.slow
async def test_orderly_locks_survive_a_broker_kill(tmp_path):
    data, port = str(tmp_path / "data"), free_port()
    path = os.path.join(data, "ownership.json")
    proc, addr = spawn_broker(data, "--queue-lock-expiry", "8", port=port)
    conns: list[BrokerConnection] = []
    try:
        async with Admin(addr) as admin:
            await admin.create_topic(T, 4)
        a, b = await _member(addr, "a"), await _member(addr, "b")
        conns += [a, b]
        assert await _lock(a, "a", [0, 1]) == [0, 1]
        assert await _lock(b, "b", [2]) == [2]
        await _saved(path, {"a", "b"})
        _kill(proc)
        for c in conns:
            c.close()

        proc, _ = spawn_broker(data, "--queue-lock-expiry", "8", port=port)
        started = time.monotonic()
        c = await _member(addr, "c")  # a member back first (or a new one)
        conns.append(c)
        assert await _lock(c, "c", [0, 1, 2, 3]) == [3]
        hdr, _ = await c.request(RequestCode.PULL, {"topic": T, "queue": 0, "offset": 0,
                                                    "max": 32, "group": G, "client": "c"})
        assert hdr["st"] == PullStatus.LOCKED  # nor can it pull a queue a still holds
        # the absent holders count as members, so c keeps the allocation it had
        assert await _members(c) == {"c": False, "a": True, "b": True}

        a = await _member(addr, "a")  # a comes back and locks its queues again
        conns.append(a)
        assert await _lock(a, "a", [0, 1]) == [0, 1]
        assert await _members(c) == {"c": False, "a": False, "b": True}
        # b never comes back: its queue is free after the expiry, counted from the restart
        assert await _lock(c, "c", [2]) == []
        while time.monotonic() - started < 8.5:
            assert await _lock(a, "a", [0, 1]) == [0, 1]  # renewals, as its client does
            await asyncio.sleep(0.5)  # the renewal period; the expiry runs on the broker's clock
        assert await _lock(c, "c", [2, 3]) == [2, 3]
        assert await _members(c) == {"c": False, "a": False}
        await _saved(path, {"a", "c"})
        _kill(proc)
        for conn in conns:
            conn.close()

        # a damaged lock file: the broker starts without the saved locks
        with open(path, "wb") as f:
            f.write(b'{"version": 1, "locks": [[')
        proc, _ = spawn_broker(data, "--queue-lock-expiry", "8", port=port)
        d = await _member(addr, "d")
        conns.append(d)
        assert await _lock(d, "d", [0, 1, 2, 3]) == [0, 1, 2, 3]
    finally:
        for conn in conns:
            conn.close()
        _kill(proc)
