"""Per-connection limits against a broker process: its memory (RSS from /proc) stays bounded
under clients that do not read, and its own files keep working with a low fd limit while
more clients try to connect than it may accept."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time

import pytest

from onceq import Admin, ErrorCode, OnceqError, Producer, PullConsumer
from onceq.protocol.codes import RequestCode
from onceq.protocol.frame import REQUEST, encode_frame
from onceq.storage.metadata import decode_checkpoint
from tests.helpers import spawn_broker, wait_until
from tests.integration.test_bad_input import Raw

MB = 1024 * 1024

pytestmark = pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"),
                                reason="needs /proc")


def status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


async def open_raw(port: int, rcvbuf: int = 4096) -> Raw:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return Raw(*await asyncio.open_connection(sock=sock))


async def wait_closed(raw: Raw, seconds: float) -> bool:
    """True when the broker closed ``raw`` within ``seconds`` (read and discard meanwhile)."""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                if not await asyncio.wait_for(raw.reader.read(1 << 20), 0.2):
                    return True
    except ConnectionResetError:
        return True
    return False


def sockets(pid: int) -> int:
    """How many sockets process ``pid`` has open (its listener and connections)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return n


def checkpointed(data_dir: str) -> int | None:
    """The log position the broker's last checkpoint of ``data_dir`` covers."""
    try:
        with open(os.path.join(data_dir, "checkpoint"), "rb") as f:
            return decode_checkpoint(f.read())
    except FileNotFoundError:
        return None


def stop(proc) -> str:
    """SIGTERM the broker; its exit code must be 0; return what it logged."""
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()
    return err.decode()


async def test_non_reading_client_with_many_held_pulls_is_dropped_rss_bounded(tmp_path):
    """600 held pulls of a client that never reads, then one 1 MiB message: without an
    output limit the broker would queue 600 MiB; with the default (64 MiB) the client is
    dropped and the broker's peak RSS grows by less than BOUND. Another client is served."""
    bound = 160 * MB  # 64 MiB limit + 8 MiB high water + answers being built + allocator
    proc, addr = spawn_broker(str(tmp_path / "d"), "--segment-size", str(64 * MB))
    try:
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        port = int(addr.rsplit(":", 1)[1])
        async with Producer(addr) as p, PullConsumer(addr, "other") as c:
            await p.send("T", b"warm-up", queue=0)
            await c.pull("T", 0, 0, 10)
            base = status(proc.pid)
            raw = await open_raw(port)
            k = 600
            # a ping after the pulls: the broker takes a connection's requests in order and
            # holds a pull as it takes it, so its answer (the only one: nothing is at offset
            # 1 yet) comes once all k pulls are held
            await raw.write(b"".join(encode_frame(REQUEST, RequestCode.PULL, i, {
                "topic": "T", "queue": 0, "offset": 1, "suspend_ms": 2000})
                for i in range(1, k + 1)) + encode_frame(REQUEST, RequestCode.PING, k + 1))
            code, corr, _hdr, _p = await raw.read_frame(10.0)
            assert (code, corr) == (0, k + 1)
            big = await p.send("T", b"m" * MB, queue=0)
            closing = asyncio.create_task(wait_closed(raw, 10.0))
            served = 0
            while not closing.done():  # another client keeps being served meanwhile
                r = await c.pull("T", 0, 0, 10)
                assert [m.queue_offset for m in r.messages] == [0, 1]
                served += 1
                await asyncio.sleep(0.05)
            assert await closing, "the non-reading client was not dropped"
            assert served >= 1  # each pull above was answered while the flood was pending
            peak = status(proc.pid)
            await raw.close()
            r = await p.send("T", b"after", queue=0)
            assert r.offset == big.offset + 1
            assert [m.body for m in (await c.pull("T", 0, 1, 10)).messages] == [
                b"m" * MB, b"after"]
        grown = peak["VmHWM"] - base["VmHWM"]
        assert grown < bound
        print(f"RSS before {base['VmRSS'] / MB:.0f} MiB, peak after {peak['VmHWM'] / MB:.0f} "
              f"MiB (+{grown / MB:.0f} MiB), now {peak['VmRSS'] / MB:.0f} MiB")
    finally:
        if proc.poll() is None:
            log = stop(proc)
            assert log.count("slow consumer") == 1, log


@pytest.mark.slow
async def test_group_changed_flood_to_non_reading_members_rss_bounded(tmp_path):
    """20 members that never read; a client flips its subscription 100,000 times, each flip
    answered before the next: the pushes coalesce, the broker's RSS barely moves."""
    bound = 24 * MB  # uncoalesced: ~800 bytes per push queued beyond the socket buffers
    proc, addr = spawn_broker(str(tmp_path / "d"))
    try:
        port = int(addr.rsplit(":", 1)[1])
        members = []
        for i in range(20):
            r = await open_raw(port)
            code, _h, _p = await r.request(RequestCode.HEARTBEAT, {
                "client": f"m{i}", "groups": [{"group": "G", "subs": {"T": "*"}}]})
            assert code == 0
            members.append(r)
        flippers = [await Raw.open(port) for _ in range(4)]
        base = status(proc.pid)

        async def flip(j: int, raw: Raw, n: int) -> None:
            for i in range(n):
                code, _h, _p = await raw.request(RequestCode.HEARTBEAT, {
                    "client": f"flip{j}",
                    "groups": [{"group": "G", "subs": {"T": "a" if i % 2 else "b"}}]},
                    corr=i + 1)
                assert code == 0

        t0 = time.monotonic()
        await asyncio.gather(*(flip(j, f, 25_000) for j, f in enumerate(flippers)))
        took = time.monotonic() - t0
        after = status(proc.pid)
        grown = after["VmHWM"] - base["VmHWM"]
        assert grown < bound
        print(f"100,000 flips in {took:.1f}s; RSS {base['VmRSS'] / MB:.0f} -> "
              f"{after['VmRSS'] / MB:.0f} MiB, peak +{grown / MB:.1f} MiB")
        # a member that starts reading is told about the group
        r = members[0]
        code, _h, _p = await r.request(RequestCode.PING, corr=777)
        assert code == 0
        for raw in members + flippers:
            await raw.close()
    finally:
        if proc.poll() is None:
            stop(proc)


@pytest.mark.slow
async def test_connection_cap_with_a_low_fd_limit(tmp_path):
    """The broker runs with 256 file descriptors; 400 clients connect and stay idle. Those
    above the cap get TOO_MANY_CONNECTIONS; earlier clients keep working; the broker creates
    new index files and checkpoints meanwhile without a failure; nothing acknowledged is
    lost across a restart."""
    data = str(tmp_path / "d")
    proc, addr = spawn_broker(data, "--segment-size", str(MB), "--max-body", str(200_000),
                              fd_limit=256)
    raws: list[Raw] = []
    try:
        port = int(addr.rsplit(":", 1)[1])
        admin = await Admin(addr).start()
        producer = await Producer(addr).start()
        await admin.create_topic("before", 2)
        refused = 0
        accepted: list[Raw] = []
        for _ in range(400):
            r = await Raw.open(port)
            raws.append(r)
        for r in raws:
            try:
                code, corr, hdr, _p = await r.read_frame(0.05)
            except TimeoutError:
                accepted.append(r)  # nothing said: accepted (checked by a ping below)
                continue
            except (EOFError, ConnectionResetError):
                pytest.fail("a client was closed without a word")
            assert (code, corr) == (ErrorCode.TOO_MANY_CONNECTIONS, 0), hdr
            refused += 1
        assert len(accepted) + refused == 400
        # 256 - 128 (reserve) - 64 (index-file cache, a quarter of the limit) - own sockets
        assert 20 <= len(accepted) <= 256 - 128 - 64
        print(f"accepted {len(accepted)}, refused {refused}")
        # accepted clients are served
        for r in accepted[::5]:
            code, _h, _p = await r.request(RequestCode.PING, corr=5)
            assert code == 0
        # a new client library connection is refused with the code
        with pytest.raises(OnceqError) as exc:
            await _new_ping(addr)
        assert exc.value.code == ErrorCode.TOO_MANY_CONNECTIONS
        # the broker's own files: 4 topics x 8 queues of new index files, segments rolled
        acked = []
        for t in range(4):
            await admin.create_topic(f"t{t}", 8)
            for q in range(8):
                for _ in range(3):
                    acked.append((f"t{t}", q, (await producer.send(
                        f"t{t}", b"x" * 100_000, queue=q)).offset))
        # checkpoints (every second) run at the cap: one fsyncs the new index files and
        # then records the log end in the checkpoint file
        log_end = (await admin.broker_status())["log_end"]
        await wait_until(lambda: (checkpointed(data) or -1) >= log_end, 30,
                         "a checkpoint covering every send")
        before = sockets(proc.pid)
        await admin.close()
        await producer.close()
        for r in raws:
            await r.close()
        raws = []
        # the broker sees the closes (it drops a connection before closing its socket); not
        # polled with connects, whose refusals would log
        await wait_until(lambda: sockets(proc.pid) <= before - 2 - len(accepted), 30,
                         "the broker to close its side of every connection")
        async with Admin(addr) as a:  # slots free again
            await a.ping()
        log = stop(proc)
        assert "Too many open files" not in log, log
        assert "failed" not in log, log
        assert "refused" in log and log.count("refused") <= 2, log  # rate-limited
    finally:
        for r in raws:
            await r.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    proc, addr = spawn_broker(data)
    try:
        async with PullConsumer(addr, "check") as c:
            for topic, q, off in acked:
                r = await c.pull(topic, q, off, 1)
                assert r.messages and r.messages[0].queue_offset == off
    finally:
        stop(proc)


async def _new_ping(addr: str) -> None:
    async with Admin(addr) as a:
        await a.ping()


async def test_large_partial_frames_slowloris_and_idle_connections(tmp_path):
    """100 connections send a frame of the largest size minus one byte, 5 trickle a frame a
    byte at a time, one sends nothing: the input budget bounds the broker's RSS, the read and
    idle timeouts close them all, and a push consumer (heartbeats, held pulls) stays
    connected and keeps consuming."""
    from onceq.client.push import PushConsumer

    max_body = MB
    max_frame = max_body + 64 * 1024
    budget = 8 * MB
    bound = 64 * MB  # without the budget: 100 x 1.06 MiB held at once
    proc, addr = spawn_broker(str(tmp_path / "d"), "--max-body", str(max_body),
                              "--segment-size", str(16 * MB), "--read-timeout", "2",
                              "--idle-timeout", "3", "--max-input-buffer-bytes", str(budget))
    got: list[bytes] = []
    consumer = None
    try:
        port = int(addr.rsplit(":", 1)[1])
        async with Admin(addr) as admin:
            await admin.create_topic("T", 2)

        async def listener(msgs, ctx):
            got.extend(m.body for m in msgs)

        consumer = PushConsumer(addr, "G", listener, consume_from="FIRST",
                                heartbeat_interval_s=1.0, pull_suspend_s=15.0)
        consumer.subscribe("T", "*")
        await consumer.start()
        async with Admin(addr) as admin:
            for _ in range(100):
                members = await admin.group_members("G")
                if members:
                    break
                await asyncio.sleep(0.05)
            (member,) = members
        base = status(proc.pid)
        t0 = time.monotonic()
        big = [await Raw.open(port) for _ in range(100)]
        frame = encode_frame(REQUEST, RequestCode.PING, 1)
        for r in big:
            r.writer.write((max_frame).to_bytes(4, "little") + frame[4:16]
                           + b"\0" * (max_frame - 12 - 1))
        slow = [await Raw.open(port) for _ in range(5)]
        idle = await Raw.open(port)

        async def trickle(r: Raw) -> None:
            data = encode_frame(REQUEST, RequestCode.PING, 1, {"pad": "x" * 100})
            with contextlib.suppress(ConnectionError):
                for b in data:
                    r.writer.write(bytes([b]))
                    await asyncio.sleep(0.5)  # the slowloris itself, not a wait

        trickles = [asyncio.create_task(trickle(r)) for r in slow]
        closed = await asyncio.gather(*(wait_closed(r, 8.0) for r in big + slow + [idle]))
        took = time.monotonic() - t0
        for t in trickles:
            t.cancel()
        peak = status(proc.pid)
        grown = peak["VmHWM"] - base["VmHWM"]
        assert all(closed)
        # the idle connection, opened after t0, is not closed before its idle timeout
        assert 3.0 <= took < 8.0 + 2.0, took
        assert grown < bound
        print(f"{sum(closed)}/106 closed in {took:.1f}s; RSS {base['VmRSS'] / MB:.0f} MiB, "
              f"peak +{grown / MB:.0f} MiB")
        # the consumer is still the same member (its connection was never closed)
        async with Producer(addr) as p:
            for i in range(10):
                await p.send("T", f"after-{i}".encode())
        for _ in range(100):
            if len(got) >= 10:
                break
            await asyncio.sleep(0.05)
        assert sorted(got) == sorted(f"after-{i}".encode() for i in range(10))
        async with Admin(addr) as admin:
            (now,) = await admin.group_members("G")
        assert (now["client"], now["peer"]) == (member["client"], member["peer"])
        for r in big + slow + [idle]:
            await r.close()
    finally:
        if consumer is not None:
            await consumer.shutdown()
        if proc.poll() is None:
            log = stop(proc)
            assert "read timeout" in log


async def test_two_hundred_clients_that_do_not_read_stay_within_the_output_budget(tmp_path):
    """200 clients that never read, each pipelining pulls of a 1 MiB message: each stays
    under its own 64 MiB limit (about 9 MiB queued at the high-water mark), 1.7 GiB in all
    without a budget. The broker drops the largest holders past its 256 MiB output budget,
    its peak RSS grows by less than BOUND, and a reading client is served."""
    bound = 480 * MB  # 256 MiB budget + answers being built + allocator slack
    proc, addr = spawn_broker(str(tmp_path / "d"), "--segment-size", str(64 * MB),
                              "--max-body", str(2 * MB))
    try:
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        port = int(addr.rsplit(":", 1)[1])
        async with Producer(addr) as p, PullConsumer(addr, "reader") as c:
            await p.send("T", b"m" * MB, queue=0)
            await c.pull("T", 0, 0, 1)
            base = status(proc.pid)
            raws = []
            pulls = b"".join(encode_frame(REQUEST, RequestCode.PULL, i, {
                "topic": "T", "queue": 0, "offset": 0}) for i in range(1, 17))
            for _ in range(200):
                raw = await open_raw(port)
                await raw.write(pulls)
                raws.append(raw)
            for _ in range(5):  # the broker has read every client's pulls meanwhile
                r = await c.pull("T", 0, 0, 1)  # and a reading client is served
                assert [m.queue_offset for m in r.messages] == [0]
            peak = status(proc.pid)
            for raw in raws:
                await raw.close()
    finally:
        log = stop(proc) if proc.poll() is None else ""
    grown = peak["VmHWM"] - base["VmHWM"]
    dropped = log.count("output budget")
    assert 0 < dropped < 200, log[-2000:]
    assert grown < bound
    print(f"{dropped} of 200 non-reading clients dropped; RSS peak +{grown / MB:.0f} MiB")
