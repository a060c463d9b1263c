"""Limits of the metrics port (broker/metrics_http.py): the connection cap, the request head
deadline and size cap, the write timeout, one request per connection. Raw sockets stand for
slow or misbehaving clients; short limits are passed in as ``HttpLimits``."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import pytest

from onceq.broker.metrics import METRICS_LIMITS, BrokerMetrics
from onceq.broker.metrics_http import HttpLimits, MetricsHttpServer
from tests.helpers import running_broker, wait_until

PARTIAL = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"  # a request head never finished


@contextlib.asynccontextmanager
async def metrics_server(tmp_path, limits: HttpLimits) -> AsyncIterator[BrokerMetrics]:
    """A broker and a metrics endpoint of it with ``limits``."""
    async with running_broker(str(tmp_path / "d")) as b:
        m = BrokerMetrics(b, limits)
        await m.start("127.0.0.1", 0)
        try:
            yield m
        finally:
            await m.stop()


async def http(port: int, head: bytes = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
               b"Connection: keep-alive\r\n\r\n", timeout: float = 5.0
               ) -> tuple[int, bytes, float]:
    """Status and body of one request, read to the end (the server closes), and the
    seconds it took."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        data = await asyncio.wait_for(reader.read(), timeout)  # to EOF: no keep-alive
    finally:
        writer.close()
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, data.partition(b"\r\n\r\n")[2], time.monotonic() - t0


class Slow:
    """A connection that sends ``PARTIAL`` and then, if trickling, one more header line
    now and then, and never ends its request head."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.closed_at: float | None = None
        self.answer = b""

    @classmethod
    async def open(cls, port: int) -> Slow:
        s = cls(*await asyncio.open_connection("127.0.0.1", port))
        s.writer.write(PARTIAL)
        return s

    def trickle(self, data: bytes = b"X-Slow: 1\r\n") -> None:
        if self.closed_at is None and not self.writer.is_closing():
            self.writer.write(data)

    async def watch(self) -> None:
        """Note when the server closes the connection, and what it answered; then close
        this side too."""
        with contextlib.suppress(ConnectionError):
            self.answer = await self.reader.read()
        self.closed_at = time.monotonic()
        self.writer.close()


async def all_closed(m: BrokerMetrics, within: float = 2.0) -> None:
    t0 = time.monotonic()
    while m.http.open_connections and time.monotonic() - t0 < within:
        await asyncio.sleep(0.02)
    assert m.http.open_connections == 0


async def open_slow(port: int, n: int) -> list[Slow]:
    conns: list[Slow] = []
    for i in range(0, n, 100):
        conns += await asyncio.gather(*(Slow.open(port) for _ in range(min(100, n - i))))
    return conns


async def trickler(conns: list[Slow], every: float, data: bytes = b"X-Slow: 1\r\n") -> None:
    while True:
        await asyncio.sleep(every)
        for c in conns:
            c.trickle(data)


def close_all(conns: list[Slow]) -> None:
    for c in conns:
        c.writer.transport.abort()


# ================================================================ under attack
async def test_scrape_while_1000_slow_connections_are_open(tmp_path):
    n, cap, deadline = 1000, 64, 2.0
    limits = HttpLimits(max_connections=cap, head_deadline_s=deadline)
    async with metrics_server(tmp_path, limits) as m:
        conns = await open_slow(m.port, n)
        opened = time.monotonic()  # each was accepted before this (the deadline's start)
        watchers = [asyncio.create_task(c.watch()) for c in conns]
        trick = asyncio.create_task(trickler(conns, 0.25))  # a header line every 0.25 s
        try:
            # all accepted: the flood took its slots by closing the oldest slow connections
            await wait_until(lambda: m.http.evicted >= n - cap, 5, "every connection accepted")
            assert m.http.open_connections <= cap
            status, body, latency = await http(m.port)
            assert status == 200, status
            assert b"onceq_connections" in body
            assert latency < 2.0
            # the slots the flood took were made by closing the oldest slow connections
            assert m.http.evicted >= n - cap
            # the rest are closed by the deadline, counted from their accept
            await asyncio.wait_for(asyncio.gather(*watchers), deadline + 2.0)
            assert max(c.closed_at for c in conns) - opened < deadline + 1.5
            assert 1 <= m.http.timed_out <= cap
            assert sum(c.answer.startswith(b"HTTP/1.1 408 ") for c in conns) \
                == m.http.timed_out
            await all_closed(m)
        finally:
            trick.cancel()
            close_all(conns)
        print(f"\nscrape latency with {n} slow connections open: {latency * 1000:.1f} ms")


async def test_slow_senders_closed_by_the_deadline(tmp_path):
    """A slowloris: header lines (or single bytes) trickled in, each well within any
    per-read timeout, never the end of the head."""
    deadline = 1.0
    limits = HttpLimits(max_connections=500, head_deadline_s=deadline)
    async with metrics_server(tmp_path, limits) as m:
        lines = await open_slow(m.port, 200)
        bytewise = await open_slow(m.port, 100)
        conns = lines + bytewise
        t0 = time.monotonic()
        watchers = [asyncio.create_task(c.watch()) for c in conns]
        tricks = [asyncio.create_task(trickler(lines, 0.1)),
                  asyncio.create_task(trickler(bytewise, 0.05, b"X"))]
        try:
            await asyncio.sleep(deadline * 0.7)
            assert not any(c.closed_at for c in conns)  # not before the deadline
            assert m.http.open_connections == len(conns)
            await asyncio.wait_for(asyncio.gather(*watchers), deadline + 1.0)
            assert max(c.closed_at for c in conns) - t0 < deadline + 0.5
            assert all(c.answer.startswith(b"HTTP/1.1 408 ") for c in conns)
            assert m.http.timed_out == len(conns)
            await all_closed(m)
            # a normal request still works afterwards
            assert (await http(m.port))[0] == 200
        finally:
            for t in tricks:
                t.cancel()
            close_all(conns)


# ================================================================ the connection cap
async def test_connection_cap_closes_the_oldest_idle(tmp_path):
    cap = 16
    async with metrics_server(tmp_path, HttpLimits(max_connections=cap)) as m:
        conns: list[Slow] = []
        for _ in range(100):  # one by one: accepted in this order
            conns.append(await Slow.open(m.port))
            await asyncio.sleep(0.002)
        watchers = [asyncio.create_task(c.watch()) for c in conns]
        try:
            await asyncio.wait_for(asyncio.gather(*watchers[:-cap]), 2.0)
            await asyncio.sleep(0.1)
            assert all(c.closed_at is None for c in conns[-cap:])  # the newest stay
            assert m.http.open_connections == cap and m.http.evicted == 100 - cap
            assert (await http(m.port))[0] == 200  # takes the oldest one's slot
            assert m.http.open_connections == cap - 1
        finally:
            close_all(conns)


async def test_refused_when_every_slot_is_rendering():
    release = asyncio.Event()

    async def slow_answer(method: bytes, path: bytes) -> tuple[str, str, bytes]:
        await release.wait()
        return "200 OK", "text/plain", b"ok\n"

    server = MetricsHttpServer(slow_answer, HttpLimits(max_connections=2))
    port = await server.start("127.0.0.1", 0)
    try:
        busy = [asyncio.create_task(http(port)) for _ in range(2)]
        await asyncio.sleep(0.1)
        status, body, _s = await http(port)
        assert (status, body) == (503, b"too many connections\n")
        assert server.refused == 1 and server.evicted == 0
        release.set()
        assert [(await t)[:2] for t in busy] == [(200, b"ok\n")] * 2
        assert server.open_connections == 0
    finally:
        await server.stop()


# ================================================================ head size, write timeout
async def test_oversized_head_refused(tmp_path):
    # the broker's own endpoint, with the default limits
    async with running_broker(str(tmp_path / "d"), metrics_port=0) as b:
        m = b.metrics
        assert m.http.limits == METRICS_LIMITS
        assert METRICS_LIMITS.max_head_bytes == 8192
        port = m.port
        start = b"GET /metrics HTTP/1.1\r\n"
        many = start + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 90) for i in range(100))
        assert len(many) > 8192
        assert (await http(port, many + b"\r\n"))[0] == 431  # many header lines
        one = start + b"X-Big: " + b"v" * 20000 + b"\r\n\r\n"
        assert (await http(port, one))[0] == 431  # one line over the cap
        endless = b"GET /" + b"a" * 100_000  # no line end at all
        status, body, _s = await http(port, endless)
        assert (status, body) == (431, b"request head too large\n")
        assert m.http.too_large == 3
        fits = start + b"X-H: " + b"v" * (8192 - len(start) - 9) + b"\r\n\r\n"
        assert len(fits) == 8192
        assert (await http(port, fits))[0] == 200
        assert (await http(port, b"HEAD /metrics HTTP/1.1\r\n\r\n"))[:2] == (200, b"")
        assert (await http(port, b"POST /metrics HTTP/1.1\r\n\r\n"))[0] == 405
        assert (await http(port, b"GET /x HTTP/1.1\r\n\r\n"))[0] == 404
        await all_closed(m)


async def test_answer_not_read_is_aborted():
    body = b"x" * (16 << 20)  # more than the socket buffers hold

    async def big(method: bytes, path: bytes) -> tuple[str, str, bytes]:
        return "200 OK", "text/plain", body

    server = MetricsHttpServer(big, HttpLimits(max_connections=2, write_timeout_s=0.5))
    port = await server.start("127.0.0.1", 0)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")  # and never read the answer
        await wait_until(lambda: server.open_connections == 1, 5, "the connection accepted")
        t0 = time.monotonic()
        while server.open_connections and time.monotonic() - t0 < 3:
            await asyncio.sleep(0.05)
        assert server.open_connections == 0 and server.write_timeouts == 1
        assert time.monotonic() - t0 >= 0.4  # not before its write timeout (0.5 s)
        assert (await http(port))[0] == 200  # not stuck; this one reads its answer
    finally:
        sock.close()
        await server.stop()


@pytest.mark.parametrize("bad", [
    {"max_connections": 0}, {"head_deadline_s": 0}, {"max_head_bytes": 10},
    {"write_timeout_s": -1},
])
def test_limits_validated(bad):
    with pytest.raises(ValueError):
        HttpLimits(**bad)
