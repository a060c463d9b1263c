"""Sequenced sends of idempotent writers at a broker: duplicates dropped, gaps refused,
the sequence table kept across restarts and beyond the dedup window."""

from __future__ import annotations

import asyncio

import pytest

from onceq import Admin, Producer, PullConsumer
from onceq.client.connection import BrokerConnection
from onceq.client.sequenced import SequencedWriter, encode_sequenced
from onceq.log.record import encode_part
from onceq.log.sequence import SEQ_PROPERTY, SEQUENCED
from onceq.protocol.codes import PullStatus, RequestCode
from onceq.protocol.errors import ErrorCode, OnceqError
from tests.helpers import free_port, running_broker, wait_until

T = "seq"


def msgs(lo: int, hi: int) -> list:
    return [(f"m{i}".encode(), f"k{i}", "", "", None) for i in range(lo, hi)]


async def bodies(addr: str, topic: str, queues: int) -> list[bytes]:
    out = []
    async with PullConsumer(addr, "check") as c:
        for q in range(queues):
            offset = 0
            while True:
                r = await c.pull(topic, q, offset, 512)
                if r.status != PullStatus.FOUND:
                    break
                out += [m.body for m in r.messages]
                offset = r.next_offset
    return out


async def send(addr: str, writer: str, epoch: int, batches: list[tuple[int, int, int]]
               ) -> SequencedWriter:
    """``batches``: (queue, first seq, count); message bodies are m<seq> per queue."""
    w = SequencedWriter(addr, writer, epoch)
    try:
        for q, seq, n in batches:
            await w.submit(T, q, seq, [(f"q{q}e{epoch}m{i}".encode(), "", "", "", None)
                                       for i in range(seq, seq + n)])
        await w.flush()
    finally:
        await w.close()
    return w


async def test_replayed_batches_are_stored_once(tmp_path):
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as a:
            await a.create_topic(T, 2)
        first = await send(addr, "w/0", 5, [(0, 0, 10), (1, 0, 4), (0, 10, 10)])
        assert (first.stored, first.duplicates) == (24, 0)
        # the same batches again, then overlapping and longer: only the new tail is stored
        again = await send(addr, "w/0", 5, [(0, 0, 10), (1, 0, 4), (0, 10, 10)])
        assert (again.stored, again.duplicates) == (0, 24)
        more = await send(addr, "w/0", 5, [(0, 15, 10), (1, 0, 6)])
        assert (more.stored, more.duplicates) == (7, 9)
        older = await send(addr, "w/0", 4, [(0, 0, 50)])  # an older epoch: all duplicate
        assert (older.stored, older.duplicates) == (0, 50)
        newer = await send(addr, "w/0", 6, [(0, 0, 3)])
        assert newer.stored == 3
        got = await bodies(addr, T, 2)
        assert len(got) == len(set(got)) == 24 + 7 + 3


async def test_gaps_and_bad_markers_are_refused(tmp_path):
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as a:
            await a.create_topic(T, 1)
        conn = await BrokerConnection.open(addr)
        try:
            async def req(epoch: int, seq: int, payload: bytes, writer: str = "w"):
                return await conn.request(RequestCode.SEND_SEQUENCED, {
                    "topic": T, "queue": 0, "writer": writer, "epoch": epoch, "seq": seq},
                    payload)

            with pytest.raises(OnceqError) as e:  # a new writer starts at 0
                await req(0, 5, encode_sequenced("w", 0, 5, msgs(0, 2), 1))
            assert e.value.code == ErrorCode.OUT_OF_ORDER_SEQUENCE
            hdr, _ = await req(0, 0, encode_sequenced("w", 0, 0, msgs(0, 3), 1))
            assert (hdr["n"], hdr["dup"]) == (3, 0)
            with pytest.raises(OnceqError) as e:  # 3 is next, not 4
                await req(0, 4, encode_sequenced("w", 0, 4, msgs(0, 1), 1))
            assert e.value.code == ErrorCode.OUT_OF_ORDER_SEQUENCE
            # the marker must name the last message; a plain batch is refused
            for bad in (encode_sequenced("w", 0, 2, msgs(0, 2), 1),
                        encode_sequenced("other", 0, 3, msgs(0, 2), 1),
                        b"".join(len(p).to_bytes(4, "little") + p
                                 for p in [encode_part(b"x", "k", 1)])):
                with pytest.raises(OnceqError) as e:
                    await req(0, 3, bad)
                assert e.value.code == ErrorCode.INVALID_SEQUENCE
            for writer in ("", "x" * 201, "a\nb"):
                with pytest.raises(OnceqError) as e:
                    await req(0, 3, encode_sequenced("w", 0, 3, msgs(0, 1), 1), writer)
                assert e.value.code == ErrorCode.INVALID_SEQUENCE
            with pytest.raises(OnceqError) as e:  # internal topics take no writers
                await conn.request(RequestCode.SEND_SEQUENCED, {
                    "topic": "%RETRY%g", "queue": 0, "writer": "w", "epoch": 0, "seq": 0},
                    encode_sequenced("w", 0, 0, msgs(0, 1), 1))
            assert e.value.code == ErrorCode.INVALID_ARGUMENT
            # an ordinary send may not forge a sequence
            forged = encode_part(b"x", "k", 1, properties={SEQ_PROPERTY: "9:9:w"},
                                 flags=SEQUENCED)
            with pytest.raises(OnceqError) as e:
                await conn.request(RequestCode.SEND, {"topic": T, "queue": 0},
                                   len(forged).to_bytes(4, "little") + forged)
            assert e.value.code == ErrorCode.INVALID_SEQUENCE
            hdr, _ = await req(0, 3, encode_sequenced("w", 0, 3, msgs(3, 5), 1))
            assert (hdr["base"], hdr["n"]) == (3, 2)
        finally:
            conn.close()


async def test_internal_copies_never_carry_a_writers_sequence(tmp_path):
    """Neither a forged flag sent to the schedule topic (it would reach the real topic when
    due) nor the broker's own copies of a sequenced message (retry, dead letter) carry
    the flag that the log's replay takes for a writer's sequence."""
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as a:
            await a.create_topic(T, 1)
        conn = await BrokerConnection.open(addr)
        try:
            forged = encode_part(b"x", "k", 1, properties={
                SEQ_PROPERTY: "999:0:w", "REAL_TOPIC": T, "REAL_QID": "0",
                "DELIVER_AT_MS": "0"}, flags=SEQUENCED)
            with pytest.raises(OnceqError) as e:  # clients cannot write system topics
                await conn.request(RequestCode.SEND, {"topic": "%SCHEDULE%", "queue": 0},
                                   len(forged).to_bytes(4, "little") + forged)
            assert e.value.code == ErrorCode.INVALID_ARGUMENT
            await send(addr, "w", 0, [(0, 0, 1)])  # stored with the flag, at offset 0
            await conn.request(RequestCode.HEARTBEAT, {"client": "c", "groups": [
                {"group": "g", "model": "CLUSTERING", "subs": {T: "*"}}]})
            for level in (1, -1):  # a retry through the schedule, and a dead letter
                await conn.request(RequestCode.CONSUMER_SEND_BACK, {
                    "group": "g", "topic": T, "queue": 0, "offset": 0,
                    "delay_level": level})
        finally:
            conn.close()
        async with PullConsumer(addr, "check") as c:
            copies = [m for topic in ("%SCHEDULE%", "%DLQ%g") for q in range(18)
                      if topic in b.store.topics and q < b.store.topics[topic].queues
                      for m in (await c.pull(topic, q, 0, 32)).messages]
        assert len(copies) == 2 and all(not m.flags & SEQUENCED for m in copies)
        assert all(SEQ_PROPERTY in m.properties for m in copies)  # only the flag goes


async def test_table_survives_restart_and_the_dedup_window(tmp_path):
    """A replay long after the dedup window (here: window off) and after a restart
    stores nothing again; a deleted and re-created topic starts afresh."""
    data = str(tmp_path / "d")
    async with running_broker(data, store_kw={"dedup_window_s": 0}) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as a:
            await a.create_topic(T, 2)
        await send(addr, "w/1", 0, [(0, 0, 100), (1, 0, 50)])
    async with running_broker(data, store_kw={"dedup_window_s": 0}) as b:
        addr = f"127.0.0.1:{b.port}"
        replay = await send(addr, "w/1", 0, [(0, 0, 100), (1, 0, 60)])
        assert (replay.stored, replay.duplicates) == (10, 150)
        assert len(await bodies(addr, T, 2)) == 160
        async with Admin(addr) as a:
            await a.delete_topic(T)
            await a.create_topic(T, 2)
        fresh = await send(addr, "w/1", 0, [(0, 0, 5)])
        assert fresh.stored == 5


async def test_idle_writers_expire(tmp_path):
    async with running_broker(str(tmp_path / "d"), writer_expiry_s=0.3,
                              offsets_save_s=0.1) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as a:
            await a.create_topic(T, 1)
        await send(addr, "w", 0, [(0, 0, 5)])
        assert len(b.sequences.table) == 1
        # forgotten (expiry 0.3 s, checked at each offsets save): a replay is stored again
        await wait_until(lambda: len(b.sequences.table) == 0, 5, "the idle writer to expire")
        assert (await send(addr, "w", 0, [(0, 0, 5)])).stored == 5


async def test_ordinary_sends_are_unchanged(tmp_path):
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as a:
            await a.create_topic(T, 1)
        async with Producer(addr) as p:
            r = await p.send_batch(T, [b"a", b"b"], queue=0)
        assert [x.offset for x in r] == [0, 1]


async def test_cut_connections_are_resent_without_duplicates(tmp_path):
    """The connection is cut (abort) while sends are in flight, again and again: the
    writer re-sends what was not acknowledged, and each message is stored once."""
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as a:
            await a.create_topic(T, 2)
        w = SequencedWriter(addr, "cut/0", 3, window=4)
        try:
            seqs = {0: 0, 1: 0}
            for i in range(60):
                q = i % 2
                await w.submit(T, q, seqs[q], [(f"q{q}s{s}".encode(), "", "", "", None)
                                               for s in range(seqs[q], seqs[q] + 25)])
                seqs[q] += 25
                if i % 7 == 3 and w._conn is not None:
                    w._conn._transport.abort()  # cut: replies of the sends in flight lost
            await w.flush()
        finally:
            await w.close()
        got = await bodies(addr, T, 2)
        assert len(got) == len(set(got)) == 60 * 25
        # sends stored before their reply was lost came back as duplicates when re-sent
        assert w.stored + w.duplicates == 60 * 25 and w.duplicates > 0


async def test_a_writer_waits_for_a_broker_out_of_reach_within_its_timeout(tmp_path):
    """The broker is down when the writer starts and submits: the writer keeps trying
    (the queue count and the batch) until it is back, within its timeout."""
    data, port = str(tmp_path / "d"), free_port()
    async with running_broker(data, port=port) as b, Admin(f"127.0.0.1:{b.port}") as a:
        await a.create_topic(T, 2)
    addr = f"127.0.0.1:{port}"
    w = SequencedWriter(addr, "w", 0, timeout=20)
    attempts: list[str] = []  # the addresses of the writer's connection attempts
    connect = w._connect

    async def counted(address, *args):
        attempts.append(address)
        return await connect(address, *args)

    w._connect = counted

    async def back_later():
        # the outage the writer rides out (the scenario itself): over once the writer has
        # tried to connect three times
        await wait_until(lambda: len(attempts) >= 3, 20, "the writer to try three times")
        async with running_broker(data, port=port):
            await done.wait()

    done = asyncio.Event()
    broker = asyncio.create_task(back_later())
    try:
        assert await w.queue_count(T) == 2
        await w.submit(T, 0, 0, msgs(0, 3))
        await w.flush()
        assert (w.stored, w.duplicates) == (3, 0)
        with pytest.raises(ValueError):
            await w.submit(T, 0, 3, [])
    finally:
        await w.close()
        done.set()
        await broker
    async with running_broker(data) as b:
        assert len(await bodies(f"127.0.0.1:{b.port}", T, 2)) == 3
