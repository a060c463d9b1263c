"""The broker's small shared parts without a broker: header field checks, durable answers
and the commit rule (stub store and flusher, the suite's fake clock; no sockets)."""

from __future__ import annotations

import asyncio
import struct
from types import SimpleNamespace

import pytest

from onceq.broker.commit_rule import CommitRule
from onceq.broker.durable import DurableReplies
from onceq.broker.fields import int_field, split_parts, str_field, user_topic
from onceq.broker.offset_reset import ResetFence
from onceq.broker.queue_lock import QueueLocks
from onceq.log.offset_record import OFFSETS_TOPIC
from onceq.protocol.errors import ErrorCode, OnceqError
from tests.unit.test_transition import G, StubStore, T, join, make

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


def test_fields_check_their_types():
    h = {"n": 3, "flag": True, "s": "x"}
    assert int_field(h, "n") == 3 and int_field(h, "missing", 7) == 7
    assert str_field(h, "s") == "x"
    for check, name in ((int_field, "flag"), (int_field, "s"), (str_field, "n"),
                        (str_field, "missing")):
        with pytest.raises(OnceqError) as err:
            check(h, name)
        assert err.value.code == ErrorCode.INVALID_ARGUMENT and repr(name) in err.value.message
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
    assert _replies(100, None).reply(conn, 1, {"a": 1}) == (0, {"a": 1}, b"")
    assert _replies(100, _Flusher(False, 0)).reply(conn, 1, {}) == (0, {}, b"")
    assert _replies(100, _Flusher(True, 100)).reply(conn, 1, {}) == (0, {}, b"")
    assert _replies(100, _Flusher(True, 50)).reply(conn, 1, {}, end=50) == (0, {}, b"")
    assert conn.answers == []


async def test_a_sync_reply_waits_for_the_fsync_of_its_end():
    conn, flusher = _Conn(), _Flusher(True, 10)
    d = _replies(100, flusher)
    assert d.reply(conn, 7, {"ok": 1}) is None  # default end: everything written so far
    assert d.reply(conn, 8, {"ok": 2}, end=40) is None
    assert d.reply(conn, 9, {"ok": 3}, end=60) is None
    assert [e for e, _ in flusher.waits] == [100, 40, 60]
    flusher.waits[0][1].set_result(None)
    flusher.waits[1][1].set_exception(OnceqError(ErrorCode.DISK_FULL, "full"))
    flusher.waits[2][1].cancel()
    await asyncio.sleep(0)
    assert conn.answers == [(7, 0, {"ok": 1}),
                            (8, int(ErrorCode.DISK_FULL), {"message": "full"}),
                            (9, int(ErrorCode.FLUSH_TIMEOUT),
                             {"message": OnceqError(ErrorCode.FLUSH_TIMEOUT).message})]


# -- whose commits count -----------------------------------------------------------------------


def _rule():
    transition, groups, clock, _ = make()
    queue_locks = QueueLocks(StubStore(), clock, 60.0, groups=groups, transition=transition,
                             fence=ResetFence(), durable=_replies(0, None))
    return CommitRule(transition, queue_locks), transition, queue_locks, groups, clock


def test_a_free_queue_takes_commits_from_anyone_the_access_lock_does_not_apply_to():
    rule, _, _, groups, _ = _rule()
    join(groups, "a")  # the access lock applies to it
    join(groups, "plain", lock=False)
    assert rule.may_commit(group=G, client=None, topic=T, queue=0)  # a pull consumer
    assert rule.may_commit(group=G, client="plain", topic=T, queue=0)
    assert not rule.may_commit(group=G, client="a", topic=T, queue=0)  # must hold it first


def test_only_the_access_lock_holder_commits():
    rule, transition, _, groups, _ = _rule()
    join(groups, "a")
    join(groups, "b")
    join(groups, "plain", lock=False)
    assert transition.check(G, "a", T, 0, requested=0).granted
    assert rule.may_commit(group=G, client="a", topic=T, queue=0)
    for client in ("b", "plain", None):
        assert not rule.may_commit(group=G, client=client, topic=T, queue=0)
    assert rule.may_commit(group=G, client="b", topic=T, queue=1) is False  # not held by b
    assert rule.may_commit(group=G, client=None, topic=T, queue=1)  # free


def test_only_the_orderly_lock_holder_commits():
    rule, _, queue_locks, groups, clock = _rule()
    join(groups, "o", lock=False)
    join(groups, "plain", lock=False)
    assert queue_locks.table.lock(G, "o", [(T, 2)], clock(), lambda t, q: None) == {(T, 2)}
    assert rule.may_commit(group=G, client="o", topic=T, queue=2)
    assert not rule.may_commit(group=G, client="plain", topic=T, queue=2)
    assert not rule.may_commit(group=G, client=None, topic=T, queue=2)
    clock.advance(61)  # the orderly lock expired without renewal
    assert rule.may_commit(group=G, client="plain", topic=T, queue=2)
