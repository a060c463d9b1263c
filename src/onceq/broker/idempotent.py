"""Sequenced sends of idempotent writers (``SEND_SEQUENCED``; see ``log/sequence.py``).

Request header: ``topic``, ``queue``, ``writer`` (id), ``epoch`` and ``seq`` (the number of
the batch's first message; the others follow). The last part must carry the ``SEQUENCED``
flag and ``WRITER_SEQ = "epoch:last seq:writer"``; no other part may carry the flag.

Answer: ``queue``, ``dup`` (how many leading messages were already stored: not stored
again), ``base`` and ``n`` (offsets of the messages stored now; ``n`` may be 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgpack

from ..log.record import PART_FIXED, PART_FIXED_SIZE
from ..log.sequence import SEQ_PROPERTY, SEQUENCED, SequenceError, check_writer_id, marker
from ..protocol.codes import SYSTEM_PREFIX
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import SequencedReply

if TYPE_CHECKING:
    from ..protocol.requests import SendSequenced
    from ..storage.sequences import SequenceStore
    from ..storage.store import MessageStore


# the SEQUENCED flag is the high bit of the part's u16 flags (bytes 8-9, little endian)
_FLAG_BYTE = 9
_FLAG_BIT = SEQUENCED >> 8
assert SEQUENCED == _FLAG_BIT << 8


def _flagged(parts: list[memoryview]) -> list[int]:
    """Indexes of the parts that carry the SEQUENCED flag (one byte read per part)."""
    return [i for i, p in enumerate(parts) if len(p) > _FLAG_BYTE and p[_FLAG_BYTE] & _FLAG_BIT]


def refuse_sequenced(parts: list[memoryview]) -> None:
    """An ordinary send must not carry the flag that marks a writer's sequence: the replay
    of the log would take the message for one at the next restart. (Sends name user topics
    only; the broker's own copies into system topics clear the flag, ``retry.py``.)"""
    if _flagged(parts):
        refuse_sequenced_flag()


def refuse_sequenced_flag() -> None:
    raise OnceqError(ErrorCode.INVALID_SEQUENCE, "the SEQUENCED message flag is "
                     "reserved for sequenced sends (SEND_SEQUENCED)")


def check_marker(parts: list[memoryview], writer: str, epoch: int, last: int) -> None:
    """The last part, and only it, carries the batch's sequence."""
    want = marker(writer, epoch, last)
    if _flagged(parts) != [len(parts) - 1]:
        raise OnceqError(ErrorCode.INVALID_SEQUENCE, (
            f"the last message of a sequenced batch, and only it, must carry the SEQUENCED "
            f"flag and the property {SEQ_PROPERTY}={want!r}"))
    tail = parts[-1]
    if len(tail) < PART_FIXED_SIZE:
        raise OnceqError(ErrorCode.BAD_REQUEST, "malformed message: message part too short")
    _born, _flags, _rc, ulen, tlen, klen, plen, _blen = PART_FIXED.unpack_from(tail)
    p = PART_FIXED_SIZE + ulen + tlen + klen
    try:
        props = msgpack.unpackb(tail[p:p + plen], raw=False) if plen else {}
    except Exception:  # msgpack raises several types
        props = None
    if not isinstance(props, dict) or props.get(SEQ_PROPERTY) != want:
        raise OnceqError(ErrorCode.INVALID_SEQUENCE, (
            f"the last message of the batch must carry the property {SEQ_PROPERTY}={want!r}"))


def send_sequenced(store: MessageStore, sequences: SequenceStore, req: SendSequenced,
                   parts: list[memoryview], *, topic: str) -> tuple[SequencedReply, int | None]:
    """Store the batch's messages not stored yet; return the answer and the log position
    it is durable at (None: once everything written so far is)."""
    try:
        writer = check_writer_id(req.writer)
    except SequenceError as exc:
        raise OnceqError(ErrorCode.INVALID_SEQUENCE, str(exc)) from None
    epoch, seq, queue = req.epoch, req.seq, req.queue  # checked (``protocol/requests.py``)
    if topic.startswith(SYSTEM_PREFIX):
        raise OnceqError(ErrorCode.INVALID_ARGUMENT, f"topic {topic!r} is internal to the "
                         "broker: sequenced sends go to user topics")
    if not parts:
        raise OnceqError(ErrorCode.BAD_REQUEST, "a sequenced batch must not be empty")
    last = seq + len(parts) - 1
    check_marker(parts, writer, epoch, last)
    store.get_topic(topic)  # TOPIC_NOT_EXIST before a sequence error
    table = sequences.table
    key = (writer, topic, queue)
    try:
        dup = table.check(key, epoch, seq, len(parts))
    except SequenceError as exc:
        code = ErrorCode.OUT_OF_ORDER_SEQUENCE if exc.gap else ErrorCode.INVALID_SEQUENCE
        raise OnceqError(code, str(exc)) from None
    if dup == len(parts):  # answered once the first copies are durable
        return SequencedReply(queue, dup), None
    # no dedup window: the sequence is the stronger check (and the last part, which
    # carries it, must be stored)
    res = store.put(topic, queue, parts[dup:], dedup=False)
    table.record(key, epoch, last, int(store.clock() * 1000), res.end_position - 1)
    return SequencedReply(queue, dup, res.offsets[0], len(res.offsets)), res.end_position
