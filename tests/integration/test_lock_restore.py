"""The access lock across a broker restart, driven request by request (in-process broker,
the suite's fake clock): saved holders come back unconfirmed, block other members until
they re-assert, give up, or the restore hold passes."""

from __future__ import annotations

import os

from onceq import Producer
from onceq.broker.broker import Broker
from onceq.broker.config import BrokerConfig
from onceq.client.connection import BrokerConnection
from onceq.protocol.codes import PullStatus, RequestCode
from onceq.protocol.errors import ErrorCode, OnceqError
from tests.clock import FakeClock
from tests.helpers import small_store

G, T = "rg", "rt"


async def _broker(data: str, clock: FakeClock) -> tuple[Broker, str]:
    b = Broker(BrokerConfig(small_store(data), port=0, access_lock_restore_hold_s=20.0),
               clock=clock)
    await b.start()
    return b, f"127.0.0.1:{b.port}"


async def _member(addr: str, client: str, held: list | None = None
                  ) -> tuple[BrokerConnection, dict]:
    conn = await BrokerConnection.open(addr)
    group = {"group": G, "model": "CLUSTERING", "subs": {T: "*"}}
    if held is not None:
        group["held"] = held
    hdr, _ = await conn.request(RequestCode.HEARTBEAT, {"client": client, "groups": [group]})
    return conn, hdr


async def _pull(conn: BrokerConnection, client: str, queue: int, offset: int = 0) -> dict:
    hdr, _ = await conn.request(RequestCode.PULL, {"topic": T, "queue": queue,
                                                   "offset": offset, "max": 32, "group": G,
                                                   "client": client})
    return hdr


async def _held_before_restart(tmp_path, clock: FakeClock) -> str:
    """Member a holds queue 0 (3 messages pulled, offset 1 committed), b holds queue 1;
    then the broker stops. Returns the data dir."""
    data = str(tmp_path / "data")
    b, addr = await _broker(data, clock)
    try:
        a, _ = await _member(addr, "a")
        await a.request(RequestCode.CREATE_TOPIC, {"topic": T, "queues": 2})
        async with Producer(addr) as p:
            await p.send_batch(T, [b"m0", b"m1", b"m2"], queue=0)
        hdr = await _pull(a, "a", 0)
        assert (hdr["st"], hdr["n"]) == (PullStatus.FOUND, 3)
        await a.request(RequestCode.COMMIT_OFFSET, {"group": G, "topic": T, "queue": 0,
                                                    "offset": 1, "client": "a"})
        bm, _ = await _member(addr, "b")
        assert (await _pull(bm, "b", 1))["st"] != PullStatus.LOCKED
    finally:
        await b.stop()  # the members are still connected when the broker goes
    a.close()
    bm.close()
    assert os.path.exists(os.path.join(data, "ownership.json"))
    return data


async def test_restored_holder_blocks_others_until_the_restore_hold_passes(tmp_path):
    clock = FakeClock()
    data = await _held_before_restart(tmp_path, clock)
    clock.advance(600)  # the broker was down for 10 minutes: the hold counts from start
    b, addr = await _broker(data, clock)
    try:
        c, _ = await _member(addr, "c")
        status = await c.request(RequestCode.QUERY_ACCESS_LOCKS, {"group": G})
        rows = {r["queue"]: r for r in status[0]["queues"]}
        assert {q: (r["holder"], r["unconfirmed"]) for q, r in rows.items()} == {
            0: ("a", True), 1: ("b", True)}
        assert rows[0]["deliver"] == 3
        # the holders that have not reconnected are listed as members, so that c's
        # allocation leaves their queues to them
        listed, _ = await c.request(RequestCode.LIST_GROUP_MEMBERS, {"group": G})
        assert [(m["client"], m.get("restored", False)) for m in listed["members"]] == [
            ("c", False), ("a", True), ("b", True)]
        assert (await _pull(c, "c", 0))["st"] == PullStatus.LOCKED
        clock.advance(19.9)
        assert (await _pull(c, "c", 0))["st"] == PullStatus.LOCKED
        clock.advance(0.1)
        hdr = await _pull(c, "c", 0)
        assert hdr["st"] == PullStatus.FOUND and hdr["n"] == 2  # from the ack offset 1
        listed, _ = await c.request(RequestCode.LIST_GROUP_MEMBERS, {"group": G})
        assert [m["client"] for m in listed["members"]] == ["c"]  # the hold has passed
        c.close()
    finally:
        await b.stop()


async def test_reasserting_holder_keeps_its_queue_and_its_commits_count(tmp_path):
    clock = FakeClock()
    data = await _held_before_restart(tmp_path, clock)
    b, addr = await _broker(data, clock)
    try:
        a, hdr = await _member(addr, "a", held=[[T, 0, 3]])
        assert hdr["holds"] == [[G, T, 0, True]]
        # the offset of work finished before the restart, sent again, is applied
        await a.request(RequestCode.COMMIT_OFFSET, {"group": G, "topic": T, "queue": 0,
                                                    "offset": 3, "client": "a"})
        c, _ = await _member(addr, "c")
        clock.advance(25)  # past the restore hold: a confirmed holder is not displaced
        await a.request(RequestCode.HEARTBEAT, {"client": "a", "groups": [
            {"group": G, "model": "CLUSTERING", "subs": {T: "*"}, "held": [[T, 0, 3]]}]})
        assert (await _pull(c, "c", 0))["st"] == PullStatus.LOCKED
        # b's queue: b never came back, so the restore hold has passed for it
        assert (await _pull(c, "c", 1))["st"] != PullStatus.LOCKED
        got, _ = await c.request(RequestCode.GET_OFFSET, {"group": G, "topic": T, "queue": 0})
        assert got["offset"] == 3
        a.close()
        c.close()
    finally:
        await b.stop()


async def test_holder_that_no_longer_holds_gives_the_queue_up_at_once(tmp_path):
    clock = FakeClock()
    data = await _held_before_restart(tmp_path, clock)
    b, addr = await _broker(data, clock)
    try:
        c, _ = await _member(addr, "c")
        assert (await _pull(c, "c", 0))["st"] == PullStatus.LOCKED
        a, hdr = await _member(addr, "a", held=[])  # reconnected, holds nothing any more
        assert hdr["holds"] == []
        listed, _ = await c.request(RequestCode.LIST_GROUP_MEMBERS, {"group": G})
        assert [(m["client"], m.get("restored", False)) for m in listed["members"]] == [
            ("a", False), ("c", False), ("b", True)]
        hdr = await _pull(c, "c", 0)
        assert hdr["st"] == PullStatus.FOUND and hdr["n"] == 2
        a.close()
        c.close()
    finally:
        await b.stop()


async def test_bad_held_field_is_refused(tmp_path):
    clock = FakeClock()
    b, addr = await _broker(str(tmp_path / "d"), clock)
    try:
        for bad in ([["t", "0", 1]], "x", [["t", 0]], [["t", 0, True]]):
            conn = await BrokerConnection.open(addr)
            try:
                await conn.request(RequestCode.HEARTBEAT, {"client": "a", "groups": [
                    {"group": G, "held": bad}]})
            except OnceqError as exc:
                assert exc.code == ErrorCode.INVALID_ARGUMENT, exc
            else:
                raise AssertionError(f"held={bad!r} was accepted")
            conn.close()
    finally:
        await b.stop()
