"""Per-connection limits in an in-process broker: slow consumers, coalesced pushes, read and
idle timeouts, the connection cap. Raw sockets stand for misbehaving clients."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest

from onceq import Admin, ErrorCode, OnceqError, Producer, PullConsumer, PullStatus
from onceq.protocol.codes import PushCode, RequestCode
from onceq.protocol.frame import PUSH, REQUEST, decode_header, encode_frame
from tests.clock import FakeClock
from tests.helpers import running_broker, wait_until
from tests.integration.test_bad_input import Raw, batch, part, raw_frame

FAST = {"read_timeout_s": 0.5, "idle_timeout_s": 1.0}


async def open_raw(port: int, rcvbuf: int | None = None) -> Raw:
    """A raw client; a small receive buffer makes a non-reading client fill up quickly."""
    if rcvbuf is None:
        return await Raw.open(port)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return Raw(*await asyncio.open_connection(sock=sock))


def broker_side(broker, raw: Raw):
    host, port = raw.writer.get_extra_info("sockname")[:2]
    (conn,) = [c for c in broker.connections if c.peer == f"{host}:{port}"]
    return conn


async def closed_within(raw: Raw, seconds: float) -> float:
    """Seconds until the broker closes ``raw`` (fails when it stays open longer)."""
    t0 = time.monotonic()
    try:
        while True:
            data = await asyncio.wait_for(raw.reader.read(65536), seconds)
            if not data:
                break
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


async def still_open(raw: Raw) -> bool:
    try:
        code, _h, _p = await raw.request(RequestCode.PING, corr=99)
    except (EOFError, ConnectionError, TimeoutError):
        return False
    return code == 0


# ================================================================ read and idle timeouts
async def test_partial_frame_trickle_is_closed_after_the_read_timeout(tmp_path):
    async with running_broker(str(tmp_path / "d"), **FAST) as broker:
        slow = await Raw.open(broker.port)
        frame = encode_frame(REQUEST, RequestCode.PING, 1, {"pad": "x" * 200})

        async def trickle() -> None:
            for b in frame[:-1]:  # never the last byte
                slow.writer.write(bytes([b]))
                await asyncio.sleep(0.05)

        task = asyncio.create_task(trickle())
        t = await closed_within(slow, 5.0)
        task.cancel()
        assert 0.45 <= t < 2.5  # read timeout 0.5 s, sweep every 0.125 s
        assert not broker.connections  # and its memory with it
        # one byte every 50 ms counts as activity: it was the read timeout, not idleness
        assert t < FAST["idle_timeout_s"] + 0.5


async def test_maximal_partial_frame_is_dropped_by_the_read_timeout(tmp_path):
    """A frame of almost the largest allowed size that never completes: the buffered bytes
    (bounded by the max frame size) are released when the read timeout closes it."""
    async with running_broker(str(tmp_path / "d"), **FAST) as broker:
        max_frame = broker.config.store.max_body + 64 * 1024
        raws = [await Raw.open(broker.port) for _ in range(5)]
        for r in raws:  # everything but the last byte
            r.writer.write(raw_frame(max_frame) + b"\0" * (max_frame - 12 - 1))
            await r.writer.drain()
        await wait_until(lambda: len(broker.connections) == 5 and max(
            c.decoder.buffered for c in broker.connections) > max_frame // 2, 5,
            "the partial frames read")
        buffered = [c.decoder.buffered for c in broker.connections]
        assert len(buffered) == 5 and all(b < 4 + max_frame for b in buffered)
        assert max(buffered) > max_frame // 2
        times = await asyncio.gather(*(closed_within(r, 5.0) for r in raws))
        assert max(times) < 2.5
        assert not broker.connections


async def test_idle_connection_is_closed_heartbeating_and_waiting_ones_are_not(tmp_path):
    async with running_broker(str(tmp_path / "d"), **FAST) as broker:
        async with Admin(f"127.0.0.1:{broker.port}") as admin:
            await admin.create_topic("T", 1)
        idle = await Raw.open(broker.port)
        beating = await Raw.open(broker.port)
        waiting = await Raw.open(broker.port)
        # a long-poll pull held for 2.5 s: longer than the idle timeout
        await waiting.write(encode_frame(REQUEST, RequestCode.PULL, 7, {
            "topic": "T", "queue": 0, "offset": 0, "suspend_ms": 2500}))
        hb = {"client": "c1", "groups": [{"group": "G", "subs": {"T": "*"}}]}

        async def heartbeats() -> None:
            for i in range(12):  # every 0.25 s for 3 s
                code, _h, _p = await beating.request(RequestCode.HEARTBEAT, hb, corr=i + 1)
                assert code == 0
                await asyncio.sleep(0.25)

        t0 = time.monotonic()
        beat = asyncio.create_task(heartbeats())
        t_idle = await closed_within(idle, 5.0)
        assert 0.95 <= t_idle < 2.5
        code, corr, hdr, _p = await waiting.read_frame(5.0)  # answered at the hold's end,
        assert (code, corr, hdr["st"]) == (0, 7, PullStatus.NO_NEW_MESSAGE)  # not closed
        assert time.monotonic() - t0 >= 2.4
        await beat  # the heartbeating member stayed connected throughout
        assert await still_open(beating)
        # once the pull is answered, the waiting connection is idle like any other
        assert await closed_within(waiting, 3.0) < 2.5
        await beating.close()


async def test_timeouts_off(tmp_path):
    async with running_broker(str(tmp_path / "d"), read_timeout_s=0, idle_timeout_s=0
                              ) as broker:
        raw = await Raw.open(broker.port)
        await raw.write(encode_frame(REQUEST, RequestCode.PING, 1)[:5])
        await wait_until(lambda: [c.decoder.buffered for c in broker.connections] == [5], 5,
                         "the partial frame read")
        clock = FakeClock()
        broker.guard.clock = clock  # an hour passes between two sweeps
        broker.guard.sweep(broker.connections)
        clock.advance(3600)
        broker.guard.sweep(broker.connections)
        assert len(broker.connections) == 1
        assert not any(c.closed for c in broker.connections)
        await raw.close()


# ================================================================ output limits
@pytest.mark.slow
async def test_pushes_to_non_reading_members_coalesce(tmp_path):
    """While a member has output unsent, a push waits and later ones of the same group
    replace it; each sweep sends the latest: a member that does not read gets a handful of
    pushes queued, not one per change, and a reader finally sees the latest."""
    async with running_broker(str(tmp_path / "d")) as broker:
        members = []
        for i in range(20):
            r = await open_raw(broker.port, rcvbuf=4096)
            code, _h, _p = await r.request(RequestCode.HEARTBEAT, {
                "client": f"m{i}", "groups": [{"group": "G", "subs": {"T": "*"}}]})
            assert code == 0
            conn = broker_side(broker, r)  # no kernel buffer to hide the pushes in
            conn.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            members.append((r, conn))
        flipper = await Raw.open(broker.port)
        flips = 20_000
        frames = [encode_frame(REQUEST, RequestCode.HEARTBEAT, i + 1, {
            "client": "flip", "groups": [{"group": "G", "subs": {"T": "a" if i % 2 else "b"}}]})
            for i in range(flips)]
        for f in frames:  # one at a time: each change is pushed in a loop pass of its own
            await flipper.write(f)
            code, _c, _h, _p = await flipper.read_frame(5.0)
            assert code == 0
        await asyncio.sleep(0.1)
        push_bytes = len(encode_frame(PUSH, PushCode.GROUP_CHANGED, 0, {
            "group": "G", "client": "flip", "reason": "subscription"}))
        bound = 8192 + 64 * push_bytes  # socket buffers, then one push per sweep
        assert flips * push_bytes > 10 * bound  # without coalescing: far above the bound
        for _r, conn in members:
            assert conn.pending_output() < bound
            assert len(conn._pushes) <= 1
        # a member that reads gets pushes up to the latest state of the group
        r, conn = members[0]
        deadline = time.monotonic() + 2.5  # sweeps send what waited, within a second
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(r.read_frame(0.2), 0.3)
        got = len(r.pushes)
        last = decode_header(r.pushes[-1][4]) if r.pushes else None
        assert 0 < got < flips
        assert not conn._pushes
        assert last == {"group": "G", "client": "flip", "reason": "subscription"}
        for r, _c in members:
            await r.close()
        await flipper.close()


async def test_many_held_pulls_answered_at_once_wait_for_a_reading_client(tmp_path):
    """20 pulls held on one queue answered by one 3.9 MB batch (78 MB of answers, above the
    64 MiB output limit): a client that reads gets them all, paced by its reading."""
    store_kw = {"max_body": 4 * 1024 * 1024, "segment_size": 64 * 1024 * 1024}
    async with running_broker(str(tmp_path / "d"), store_kw=store_kw) as broker:
        addr = f"127.0.0.1:{broker.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("B", 1)
        raw = await open_raw(broker.port, rcvbuf=65536)
        n = 20
        await raw.write(b"".join(encode_frame(REQUEST, RequestCode.PULL, i, {
            "topic": "B", "queue": 0, "offset": 0, "max": 1024, "suspend_ms": 10_000})
            for i in range(1, n + 1)))
        await wait_until(lambda: sum(len(v) for v in broker.holds.held.values()) == n, 5,
                         "every pull held")
        body = b"b" * 60_000
        parts = [part(body, f"K{i}") for i in range(65)]
        async with Producer(addr) as p:
            await p._request(RequestCode.SEND_BATCH, {"topic": "B", "queue": 0},
                             batch(*parts))
        conn = broker_side(broker, raw)
        peak = 0
        got = []
        for _ in range(n):
            peak = max(peak, conn.pending_output())
            code, corr, hdr, _payload = await raw.read_frame(10.0)
            assert code == 0 and hdr["n"] == 65
            got.append(corr)
            await asyncio.sleep(0.01)  # a slowish reader
        assert sorted(got) == list(range(1, n + 1))
        assert peak < broker.config.max_output_bytes
        assert not conn.closed
        await raw.close()


async def test_non_reading_client_over_the_output_limit_is_dropped(tmp_path):
    """Held pulls of a client that never reads: answered when their hold ends, until the
    queued output passes max_output_bytes; then the client is dropped with its group
    membership and locks, and others are served."""
    store_kw = {"max_body": 1024 * 1024 + 1024, "segment_size": 16 * 1024 * 1024}
    async with running_broker(str(tmp_path / "d"), store_kw=store_kw,
                              max_output_bytes=20 * 1024 * 1024,
                              max_pull_bytes=2 * 1024 * 1024) as broker:
        addr = f"127.0.0.1:{broker.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        raw = await open_raw(broker.port, rcvbuf=4096)
        code, _h, _p = await raw.request(RequestCode.HEARTBEAT, {
            "client": "sleepy", "groups": [{"group": "G", "subs": {"T": "*"}}]})
        assert code == 0
        conn = broker_side(broker, raw)
        conn.transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        k = 100
        await raw.write(b"".join(encode_frame(REQUEST, RequestCode.PULL, i, {
            "topic": "T", "queue": 0, "offset": 0, "suspend_ms": 1000, "group": "G",
            "client": "sleepy"}) for i in range(1, k + 1)))
        await wait_until(lambda: sum(len(v) for v in broker.holds.held.values()) == k, 5,
                         "every pull held")
        assert broker.groups.member("G", "sleepy") is not None
        async with Producer(addr) as p:
            await p.send("T", b"m" * (1024 * 1024), queue=0)
            peak = 0
            t0 = time.monotonic()
            while not conn.closed and time.monotonic() - t0 < 5:
                peak = max(peak, conn.pending_output())
                await asyncio.sleep(0.01)
            assert conn.closed  # dropped as a slow consumer
            assert peak <= 20 * 1024 * 1024 + 2 * 1024 * 1024
            await asyncio.sleep(0.1)
            assert conn not in broker.connections
            assert broker.groups.member("G", "sleepy") is None  # released as on disconnect
            assert not broker.holds.connections()
            r = await p.send("T", b"after", queue=0)  # others are served
        async with PullConsumer(addr, "G2") as c:
            res = await c.pull("T", 0, 0, 10)
            assert [m.body for m in res.messages] == [b"m" * (1024 * 1024), b"after"]
            assert res.messages[1].queue_offset == r.offset


async def test_clients_that_do_not_read_share_one_output_budget(tmp_path, caplog):
    """Twelve clients that never read, each under its own output limit: together above the
    broker's output budget, the ones holding the most are dropped until the rest fit, and
    a reading client is served meanwhile."""
    mb = 1024 * 1024
    store_kw = {"max_body": mb + 1024, "segment_size": 16 * mb}
    async with running_broker(str(tmp_path / "d"), store_kw=store_kw,
                              max_output_bytes=20 * mb, max_pull_bytes=2 * mb) as broker:
        assert broker.guard.max_output == broker.config.output_budget() == 256 * mb
        broker.guard.max_output = budget = 40 * mb
        addr = f"127.0.0.1:{broker.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        async with Producer(addr) as p:
            await p.send("T", b"m" * mb, queue=0)
        raws, conns = [], []
        for _ in range(12):
            raw = await open_raw(broker.port, rcvbuf=4096)
            await raw.request(RequestCode.PING, corr=1)
            conn = broker_side(broker, raw)
            conn.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            await raw.write(b"".join(encode_frame(REQUEST, RequestCode.PULL, i, {
                "topic": "T", "queue": 0, "offset": 0}) for i in range(2, 32)))
            raws.append(raw)
            conns.append(conn)
        async with PullConsumer(addr, "reader") as c:
            for _ in range(50):
                assert [m.queue_offset for m in (await c.pull("T", 0, 0, 1)).messages] == [0]
                if not any(x.write_paused and not x.closed and x.pending_output() < 8 * mb
                           for x in conns):
                    break  # every client left is paused at the high-water mark
                await asyncio.sleep(0.02)
        dropped = [x for x in conns if x.closed]
        kept = [x for x in conns if not x.closed]
        held = sum(x.pending_output() for x in kept if x.write_paused)
        assert dropped and kept and broker.guard.output_dropped == len(dropped)
        assert held <= budget, (held, budget)
        assert all(x.pending_output() <= 20 * mb for x in kept)
        assert sum("output budget" in r.getMessage() for r in caplog.records) == len(dropped)
        for raw in raws:
            await raw.close()
        print(f"{len(dropped)} of 12 dropped; the other {len(kept)} hold {held / mb:.1f} MiB "
              f"of a {budget / mb:.0f} MiB budget")


def test_output_limit_must_exceed_a_pull_answer(tmp_path):
    from onceq.broker.config import BrokerConfig
    from tests.helpers import small_store

    with pytest.raises(ValueError, match="max_output_bytes"):
        BrokerConfig(small_store(str(tmp_path)), max_output_bytes=16 * 1024 * 1024).validate()
    BrokerConfig(small_store(str(tmp_path)), max_output_bytes=17 * 1024 * 1024).validate()


def test_input_budget_default_and_bounds(tmp_path):
    from onceq.broker.config import BrokerConfig
    from tests.helpers import small_store

    cfg = BrokerConfig(small_store(str(tmp_path)))  # max_body 64 KiB
    assert cfg.input_budget() == 256 * 1024 * 1024
    big = BrokerConfig(small_store(str(tmp_path), max_body=100 * 1024 * 1024,
                                   segment_size=200 * 1024 * 1024))
    assert big.input_budget() == 4 * (100 * 1024 * 1024 + 64 * 1024)
    with pytest.raises(ValueError, match="max_input_buffer_bytes"):
        BrokerConfig(small_store(str(tmp_path)), max_input_buffer_bytes=200_000).validate()
    BrokerConfig(small_store(str(tmp_path)), max_input_buffer_bytes=262_144).validate()


# ================================================================ connection cap
async def test_connection_cap_refuses_with_a_clear_error(tmp_path, caplog):
    async with running_broker(str(tmp_path / "d"), max_connections=3) as broker:
        addr = f"127.0.0.1:{broker.port}"
        admin = Admin(addr)
        await admin.start()
        raws = [await Raw.open(broker.port) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert len(broker.connections) == 3
        refused = [await Raw.open(broker.port) for _ in range(5)]
        for r in refused:
            code, corr, hdr, _p = await r.read_frame(2.0)
            assert (code, corr) == (ErrorCode.TOO_MANY_CONNECTIONS, 0)
            assert "too many connections" in hdr["message"]
            assert await closed_within(r, 2.0) < 2.0
        assert OnceqError(ErrorCode.TOO_MANY_CONNECTIONS).retriable
        # a client library sees the code (after its retries)
        with pytest.raises(OnceqError) as exc:
            async with Producer(addr, send_timeout=0.5) as p:
                await p.send("T", b"x")
        assert exc.value.code == ErrorCode.TOO_MANY_CONNECTIONS
        assert [rec for rec in caplog.records if "refused" in rec.getMessage()]
        assert len([rec for rec in caplog.records if "refused" in rec.getMessage()]) == 1
        assert broker.guard.refused >= 6
        # existing clients keep working
        await admin.create_topic("T", 1)
        for r in raws:
            assert await still_open(r)
        # a freed slot is taken by the next client
        await raws[0].close()
        await asyncio.sleep(0.05)
        async with Producer(addr) as p:
            assert (await p.send("T", b"x")).offset == 0
        await admin.close()
        await raws[1].close()


async def test_connection_cap_follows_the_fd_limit(tmp_path):
    async with running_broker(str(tmp_path / "d")) as broker:
        g = broker.guard
        assert g.own_fds > 0  # at least the store's files and the listening socket
        files = broker.store.open_files  # the index-file cache's capacity is set aside
        assert g.own_fds >= files.capacity
        assert g.capacity() == g.fd_limit - g.fd_reserve - g.own_fds
        g.max_connections = 10
        assert g.capacity() == min(10, g.fd_limit - g.fd_reserve - g.own_fds)


async def test_a_client_cannot_park_pulls_without_bound(tmp_path, caplog):
    """Each held pull counts HELD_PULL_COST bytes against the output limit: a client that
    parks more is dropped, and its held pulls with it."""
    from onceq.broker.connection import HELD_PULL_COST

    limit = 10 * 1024 * 1024
    async with running_broker(str(tmp_path / "d"), max_output_bytes=limit,
                              max_pull_bytes=1024 * 1024) as broker:
        addr = f"127.0.0.1:{broker.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 4)
        most = limit // HELD_PULL_COST
        ok = await Raw.open(broker.port)  # right at the bound: kept
        await ok.write(b"".join(encode_frame(REQUEST, RequestCode.PULL, i, {
            "topic": "T", "queue": i % 4, "offset": 0, "suspend_ms": 5000})
            for i in range(1, most + 1)))
        greedy = await Raw.open(broker.port)
        await greedy.write(b"".join(encode_frame(REQUEST, RequestCode.PULL, i, {
            "topic": "T", "queue": i % 4, "offset": 0, "suspend_ms": 5000})
            for i in range(1, most + 100)))
        assert await closed_within(greedy, 5.0) < 5.0
        assert any("too many held pulls" in r.getMessage() for r in caplog.records)
        assert sum(len(v) for v in broker.holds.held.values()) == most
        assert broker_side(broker, ok).held_pulls == most
        async with Producer(addr) as p:  # one message answers the pulls of its queue
            await p.send("T", b"x", queue=0)
        got = 0
        while got < most // 4:
            code, _corr, hdr, _p = await ok.read_frame(5.0)
            assert code == 0 and hdr["n"] == 1
            got += 1
        assert broker_side(broker, ok).held_pulls == most - most // 4
        await ok.close()
        await asyncio.sleep(0.1)
        assert not broker.holds.held


async def test_partial_frames_of_all_connections_share_one_budget(tmp_path):
    """Eight connections send a frame of the largest size minus one byte. Once their partial
    frames fill the input budget, the broker stops reading connections that add to it (each
    holds at most what it had plus one read); the read timeout closes the stalled senders,
    and a producer that had to wait is read again and served."""
    max_body = 1024 * 1024
    max_frame = max_body + 64 * 1024
    budget = 2 * max_frame
    async with running_broker(str(tmp_path / "d"),
                              store_kw={"max_body": max_body, "segment_size": 4 * max_body},
                              max_input_buffer_bytes=budget, read_timeout_s=1.0,
                              idle_timeout_s=30) as broker:
        addr = f"127.0.0.1:{broker.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        guard = broker.guard
        stalled = [await Raw.open(broker.port) for _ in range(8)]
        for r in stalled:
            r.writer.write(raw_frame(max_frame) + b"\0" * (max_frame - 12 - 1))
        await wait_until(lambda: guard.blocked, 5, "the input budget to fill")
        assert guard.input_buffered > budget // 2
        # at most one socket read (256 KiB) each past the budget, not one frame each
        assert guard.input_buffered <= budget + 8 * 256 * 1024 < 8 * max_frame
        assert guard.blocked
        async with Producer(addr, send_timeout=5.0) as p:
            r = await p.send("T", b"v" * 600_000, queue=0)  # waits for the budget
        assert r.offset == 0
        times = await asyncio.gather(*(closed_within(s, 5.0) for s in stalled))
        assert max(times) < 4.0
        await asyncio.sleep(0.1)
        assert guard.input_buffered == 0 and not guard.blocked
        async with PullConsumer(addr, "g") as c:
            assert (await c.pull("T", 0, 0, 1)).messages[0].body == b"v" * 600_000


async def test_closed_connection_whose_client_does_not_read_is_aborted(tmp_path, monkeypatch):
    """A protocol error closes the connection after its answers are sent; a client that never
    reads them would keep the socket (and its buffer) forever: aborted after a grace time."""
    from onceq.broker import limits

    monkeypatch.setattr(limits, "CLOSE_GRACE_S", 0.5)
    async with running_broker(str(tmp_path / "d"), **FAST) as broker:
        addr = f"127.0.0.1:{broker.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("bulk", 1)
        async with Producer(addr) as p:
            for _ in range(20):
                await p.send("bulk", b"B" * 60_000)
        raw = await open_raw(broker.port, rcvbuf=4096)
        conn = None
        pulls = b"".join(encode_frame(REQUEST, RequestCode.PULL, i, {
            "topic": "bulk", "queue": 0, "offset": 0}) for i in range(1, 6))  # ~6 MB
        await raw.write(pulls + raw_frame(1 << 31))  # then a frame above the limit
        await asyncio.sleep(0.1)
        (conn,) = list(broker.connections)
        assert conn.closed and conn.pending_output() > 0  # closing, output not read
        t0 = time.monotonic()
        while broker.connections and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.05)
        assert not broker.connections
        assert 0.4 <= time.monotonic() - t0 < 3
        await raw.close()
