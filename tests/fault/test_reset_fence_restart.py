"""A forced offset reset survives a broker SIGKILL: a member that had not seen it when the
broker went down is still fenced after the restart (its heartbeat gets the reset again,
its commits of the old position are refused) until it acknowledges the reset."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from onceq import Admin, Producer
from onceq.client.connection import BrokerConnection
from onceq.protocol.codes import PullStatus, RequestCode
from onceq.protocol.errors import ErrorCode, OnceqError
from tests.helpers import free_port, spawn_broker

pytestmark = pytest.mark.timeout(120)

G, T = "fg", "FT"


async def _heartbeat(conn: BrokerConnection, reset_gen: int | None = None) -> dict:
    group = {"group": G, "model": "CLUSTERING", "subs": {T: "*"}}
    if reset_gen is not None:
        group["reset_gen"] = reset_gen
    hdr, _ = await conn.request(RequestCode.HEARTBEAT, {"client": "a", "groups": [group]})
    return hdr


async def _commit(conn: BrokerConnection, offset: int) -> None:
    await conn.request(RequestCode.COMMIT_OFFSET, {"group": G, "client": "a", "topic": T,
                                                   "queue": 0, "offset": offset})


async def _pull(conn: BrokerConnection, offset: int, reset_gen: int | None = None) -> dict:
    """A pull takes the queue's access lock (only its holder's commits count)."""
    h = {"topic": T, "queue": 0, "offset": offset, "max": 4, "group": G, "client": "a"}
    if reset_gen is not None:
        h["reset_gen"] = reset_gen
    hdr, _ = await conn.request(RequestCode.PULL, h)
    return hdr


async def _offset(addr: str) -> int:
    async with Admin(addr) as admin:
        return await admin.group_offset(G, T, 0)


async def test_a_forced_reset_still_fences_a_member_after_a_broker_kill(tmp_path):
    data, port = str(tmp_path / "data"), free_port()
    path = os.path.join(data, "ownership.json")
    proc, addr = spawn_broker(data, port=port)
    conns: list[BrokerConnection] = []
    try:
        async with Admin(addr) as admin:
            await admin.create_topic(T, 1)
        async with Producer(addr) as p:
            await p.send_batch(T, [b"m%d" % i for i in range(20)], queue=0)
        a = await BrokerConnection.open(addr)
        conns.append(a)
        await _heartbeat(a)
        assert (await _pull(a, 0))["st"] == PullStatus.FOUND
        await _commit(a, 10)
        async with Admin(addr) as admin:  # a never handles the push: it is fenced
            await admin.reset_offsets(G, T, to_offset=0, force=True)
        deadline = time.monotonic() + 10
        while not (os.path.exists(path)
                   and json.load(open(path, "rb"))["fences"]["fences"]):  # noqa: SIM115
            assert time.monotonic() < deadline, "the fence was never saved"
            await asyncio.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        a.close()

        proc, _ = spawn_broker(data, port=port)
        a = await BrokerConnection.open(addr)
        conns.append(a)
        answer = await _heartbeat(a)  # back with its old position, not knowing of the reset
        [notice] = answer["resets"]
        assert notice["group"] == G and notice["queues"] == [[T, 0]]
        with pytest.raises(OnceqError) as ei:
            await _commit(a, 15)  # would undo the reset
        assert ei.value.code == ErrorCode.NOT_HOLDER and "were reset" in ei.value.message
        assert (await _pull(a, 10))["st"] == PullStatus.LOCKED  # nor can it pull there
        assert await _offset(addr) == 0

        assert "resets" not in await _heartbeat(a, reset_gen=notice["gen"])  # handled now
        assert (await _pull(a, 0))["st"] == PullStatus.FOUND  # from the new offset
        await _commit(a, 3)
        assert await _offset(addr) == 3
    finally:
        for c in conns:
            c.close()
        proc.kill()
        proc.wait()
