"""The producer's retries against a scripted connection (no broker): a retriable broker
code is retried after a growing wait, a lost connection at once, a non-retriable code not
at all, and every attempt carries the same unique key."""

from __future__ import annotations

import asyncio
import time

import pytest

from onceq import Producer
from onceq.client.connection import ConnectionLost
from onceq.protocol.codes import RequestCode
from onceq.protocol.errors import ErrorCode, OnceqError


class ScriptedConnection:
    """Answers GET_TOPIC with 4 queues and each send with the next scripted outcome."""

    def __init__(self, outcomes: list) -> None:
        self.outcomes = outcomes
        self.sends: list[tuple[float, int, bytes]] = []  # (time, queue, payload)
        self.closed = False

    async def request(self, code, header=None, payload=b"", timeout=None):
        if code == RequestCode.GET_TOPIC:
            return {"topic": header["topic"], "queues": 4}, b""
        self.sends.append((time.monotonic(), header["queue"], payload))
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return {"queue": header["queue"], "base": 7, "n": 1}, b""

    def close(self) -> None:
        self.closed = True


def _producer(conn: ScriptedConnection, **kw) -> Producer:
    async def connect(address, on_push):
        return conn
    return Producer("scripted:0", connect=connect, **kw)


async def test_a_full_disk_is_retried_after_a_growing_wait_with_the_same_key():
    conn = ScriptedConnection([OnceqError(ErrorCode.DISK_FULL), OnceqError(ErrorCode.DISK_FULL),
                               "ok"])
    r = await _producer(conn, send_timeout=5.0).send("T", b"x")
    assert r.offset == 7
    (t0, _q0, p0), (t1, _q1, p1), (t2, _q2, p2) = conn.sends
    assert t1 - t0 >= 0.045 and t2 - t1 >= 0.095  # 50 ms, then 100 ms
    assert p0 == p1 == p2  # the same message, unique key included: the dedup window's key


async def test_a_lost_connection_is_retried_at_once_on_another_queue():
    conn = ScriptedConnection([ConnectionLost("cut"), "ok"])
    await _producer(conn).send("T", b"x")
    (t0, q0, _), (t1, q1, _) = conn.sends
    assert t1 - t0 < 0.04 and q1 != q0 and conn.closed


async def test_the_wait_never_outlasts_the_send_timeout():
    conn = ScriptedConnection([OnceqError(ErrorCode.SYSTEM_BUSY)] * 20)  # > retries + 1
    t0 = time.monotonic()
    with pytest.raises(OnceqError) as e:
        await _producer(conn, retries=10, send_timeout=0.3).send("T", b"x")
    assert e.value.code == ErrorCode.SYSTEM_BUSY
    assert time.monotonic() - t0 < 0.6


async def test_a_non_retriable_code_is_not_retried():
    conn = ScriptedConnection([OnceqError(ErrorCode.MESSAGE_TOO_LARGE)])
    with pytest.raises(OnceqError):
        await asyncio.wait_for(_producer(conn).send("T", b"x"), 5)
    assert len(conn.sends) == 1
