"""The broker's small shared parts without a broker: header field checks, durable answers
and the commit rule (stub store and flusher, the suite's fake clock; no sockets)."""

from __future__ import annotations

import asyncio
import struct
from types import SimpleNamespace

import pytest

from onceq.broker.connection import Connection
from onceq.broker.durable import DurableReplies
from onceq.broker.fields import Call, split_parts, user_topic
from onceq.broker.ownership import CommitDecision, QueueOwnership, Refusal, moves_forward
from onceq.log.offset_record import OFFSETS_TOPIC
from onceq.protocol.errors import ErrorCode, OnceqError
from onceq.protocol.frame import FrameDecoder, decode_header
from onceq.protocol.replies import OffsetReply

# -- header fields -----------------------------------------------------------------------------


def _batch(*parts: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def test_split_parts_reads_each_length_prefixed_part():
    assert [bytes(p) for p in split_parts(_batch(b"a", b"", b"xyz"))] == [b"a", b"", b"xyz"]


@pytest.mark.parametrize("payload, message", [
    (b"", "empty batch"),
    (b"\x01\x00", "truncated message length in batch"),
    (struct.pack("<I", 5) + b"abc", "message length exceeds the batch"),
])
def test_split_parts_refuses_malformed_batches(payload, message):
    with pytest.raises(OnceqError) as err:
        split_parts(payload)
    assert err.value.code == ErrorCode.BAD_REQUEST and err.value.message == message


def test_user_topic_refuses_the_offsets_journal():
    assert user_topic("orders") == "orders"
    with pytest.raises(OnceqError) as err:
        user_topic(OFFSETS_TOPIC)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT


# -- durable answers ---------------------------------------------------------------------------


class _Conn:
    def __init__(self) -> None:
        self.answers: list[tuple[int, int, dict]] = []

    def respond(self, corr, code, header) -> None:
        self.answers.append((corr, code, header))

    def answer(self, corr, reply) -> None:
        self.respond(corr, 0, reply.encode())


class _Flusher:
    def __init__(self, sync: bool, flushed: int) -> None:
        self.sync_policy = sync
        self.flushed = flushed
        self.waits: list[tuple[int, asyncio.Future[None]]] = []

    def wait_durable(self, end: int) -> asyncio.Future[None]:
        fut = asyncio.get_running_loop().create_future()
        self.waits.append((end, fut))
        return fut


def _replies(end: int, flusher: _Flusher | None) -> DurableReplies:
    d = DurableReplies(SimpleNamespace(log=SimpleNamespace(end=end)))
    d.flusher = flusher
    return d


async def test_a_reply_is_immediate_without_sync_flush_or_once_flushed():
    conn = _Conn()
    call = Call(conn, 1)
    r = OffsetReply(1)
    assert _replies(100, None).reply(call, r) is r
    assert _replies(100, _Flusher(False, 0)).reply(call, r) is r
    assert _replies(100, _Flusher(True, 100)).reply(call, r) is r
    assert _replies(100, _Flusher(True, 50)).reply(call, r, end=50) is r
    assert conn.answers == []


async def test_a_sync_reply_waits_for_the_fsync_of_its_end():
    conn, flusher = _Conn(), _Flusher(True, 10)
    d = _replies(100, flusher)
    # default end: everything written so far
    assert d.reply(Call(conn, 7), OffsetReply(1)) is None
    assert d.reply(Call(conn, 8), OffsetReply(2), end=40) is None
    assert d.reply(Call(conn, 9), OffsetReply(3), end=60) is None
    assert [e for e, _ in flusher.waits] == [100, 40, 60]
    flusher.waits[0][1].set_result(None)
    flusher.waits[1][1].set_exception(OnceqError(ErrorCode.DISK_FULL, "full"))
    flusher.waits[2][1].cancel()
    await asyncio.sleep(0)
    assert conn.answers == [(7, 0, {"offset": 1}),
                            (8, int(ErrorCode.DISK_FULL), {"message": "full"}),
                            (9, int(ErrorCode.FLUSH_TIMEOUT),
                             {"message": OnceqError(ErrorCode.FLUSH_TIMEOUT).message})]


# -- whose commits count: the ownership core's commit rule ------------------------------------

G, T = "g", "t"


def _rule():
    return QueueOwnership(lock_expiry=60.0)


def may(core, client, queue, locked=True, now=0.0):
    return core.refusal(G, client, T, queue, locked=locked, now=now) is None


def take(core, client, queue, now=0.0):
    assert core.pull(G, client, T, queue, 0, locked=True, ack=-1, now=now).refused is None


def test_a_free_queue_takes_commits_from_anyone_the_access_lock_does_not_apply_to():
    core = _rule()
    assert may(core, None, 0, locked=False)  # a pull consumer
    assert may(core, "plain", 0, locked=False)
    assert not may(core, "a", 0)  # the lock applies to it: it must hold the queue first


def test_only_the_access_lock_holder_commits():
    core = _rule()
    take(core, "a", 0)
    assert may(core, "a", 0)
    assert not may(core, "b", 0)
    assert not may(core, "plain", 0, locked=False)
    assert not may(core, None, 0, locked=False)
    assert not may(core, "b", 1)  # not held by b
    assert may(core, None, 1, locked=False)  # free


def test_only_the_orderly_lock_holder_commits():
    core = _rule()
    assert core.lock(G, "o", [(T, 2)], 0.0) == {(T, 2)}
    assert may(core, "o", 2, locked=False)
    assert not may(core, "plain", 2, locked=False)
    assert not may(core, None, 2, locked=False)
    assert may(core, "plain", 2, locked=False, now=61.0)  # expired without renewal


def test_offsets_only_move_forward_unless_the_stored_one_lies_past_the_queue_end():
    assert moves_forward(-1, 0, 10) and moves_forward(5, 5, 10) and moves_forward(5, 9, 10)
    assert not moves_forward(9, 5, 10)
    assert moves_forward(12, 5, 10)  # the log was cut back below the stored offset


def test_a_commit_below_the_stored_offset_is_refused_and_changes_nothing():
    core = _rule()
    take(core, "a", 0)

    def commit(client, offset, stored):
        return core.commit(G, client, T, 0, offset, locked=True, stored=stored,
                           queue_max=600, now=0.0)

    assert commit("a", 504, 116) == CommitDecision(None, 504, 504)
    for late in (116, 503):  # a stale process queue of the holder itself
        assert commit("a", late, 504) == CommitDecision(Refusal.BEHIND, 504)
    assert commit("a", 601, 504) == CommitDecision(Refusal.PAST_END, 504)
    assert commit("b", 600, 504).refused is Refusal.NOT_HOLDER  # the holder checks first
    core.reset(G, ["a"], {(T, 0)}, 1.0)  # the reset drops the lock and fences a
    assert commit("a", 600, 504).refused is Refusal.FENCED


# -- answers ------------------------------------------------------------------------------------


class _Transport:
    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data

    def writelines(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.data += b"".join(chunks)

    def get_write_buffer_size(self) -> int:
        return 0


async def test_an_answer_no_frame_can_carry_becomes_a_system_error(caplog):
    conn = Connection(SimpleNamespace(guard=None), 1 << 20, 1 << 20)
    conn.transport = _Transport()
    conn.respond(7, 0, {"gen": 2**64})  # msgpack's widest integer is 64 bits
    conn.respond(8, 0, {"ok": 1})
    await asyncio.sleep(0)  # the frames of this loop pass go out together
    decoder = FrameDecoder()
    decoder.feed(conn.transport.data)
    answers = [(corr, code, decode_header(h)) for _version, _kind, code, corr, h, _p
               in decoder.frames()]
    assert [(corr, code) for corr, code, _ in answers] == [(7, ErrorCode.SYSTEM_ERROR),
                                                           (8, 0)]
    assert "not encodable" in answers[0][2]["message"] and answers[1][2] == {"ok": 1}
    assert "cannot be encoded" in caplog.text


async def test_a_large_payload_is_written_as_it_is_behind_its_frame_head():
    conn = Connection(SimpleNamespace(guard=None), 1 << 20, 1 << 20)
    conn.transport = _Transport()
    records = bytes(range(256)) * 64  # 16 KiB: a pull's records
    conn.respond(9, 0, {"next": 5}, records)
    conn.respond(10, 0, {"ok": 1}, b"small")
    await asyncio.sleep(0)
    assert any(chunk is records for chunk in conn.transport.chunks)  # not copied
    decoder = FrameDecoder()
    decoder.feed(conn.transport.data)
    assert [(corr, decode_header(h), bytes(p)) for _v, _k, _c, corr, h, p
            in decoder.frames()] == [(9, {"next": 5}, records), (10, {"ok": 1}, b"small")]
