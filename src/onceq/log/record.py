"""Commit-log record formats (pure functions, standard library and msgpack only).

A *message part* (``part.py``) is what a producer encodes and sends; the broker stores it
verbatim inside a *record*, behind a fixed header that it fills in (queue, offsets, store
time, checksum), or a producer's batch of parts inside one *batch record* (``batch.py``).
A pull returns stored records verbatim, so the consumer decodes the same formats. All field
lengths sit in fixed headers, so one ``struct`` call reads a whole record head.

Record::

    u32 total_size      size of the whole record, this field included
    u32 crc32           zlib.crc32 of bytes [8:total_size]
    u8  RECORD_MAGIC
    u8  reserved
    u16 queue_id
    i64 queue_offset
    i64 position        commit-log position of this record
    i64 store_ts_ms
    u8  topic length    (ascii)
    ... message part
    ... topic
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import msgpack

from .batch import (
    BATCH_HEAD,
    BATCH_HEAD_SIZE,
    BATCH_RECORD_MAGIC,
    batch_count,
    build_batch_record_head,
    check_batch,
    columns,
    plain_batch,
    slice_batch,
)
from .message import BatchColumns, BatchMessage, MessageExt
from .part import (
    MIN_PART_SIZE,
    PART_FIXED,
    PART_FIXED_SIZE,
    RecordError,
    TruncatedRecord,
    check_part,
    encode_part,
    part_unique_key_and_tags,
    tag_hash,
)

__all__ = [
    "MIN_PART_SIZE", "PART_FIXED", "PART_FIXED_SIZE", "MessageExt", "RecordError",
    "TruncatedRecord", "check_part", "encode_part", "part_unique_key_and_tags", "tag_hash",
]

RECORD_MAGIC = 0xA2
RECORD_MAGICS = (RECORD_MAGIC, BATCH_RECORD_MAGIC)
REC_HEADER = struct.Struct("<IIBBHqqqB")
REC_HEADER_SIZE = REC_HEADER.size  # 37
REC_HEAD_AND_PART = struct.Struct("<IIBBHqqqBqHHBHHII")  # both fixed headers in one read
MAX_RECORD_SIZE = 64 * 1024 * 1024
_U32 = struct.Struct("<I")

REC_TAIL = struct.Struct("<BBHqqqB")  # the header after total_size and crc32
_U32x2 = struct.Struct("<II")


def build_record_parts(
    topic_bytes: bytes, queue_id: int, queue_offset: int, position: int, store_ts_ms: int,
    part: bytes | memoryview,
) -> tuple[bytes, bytes]:
    """A record as (header, trailer) around ``part``: the bytes are header + part + trailer.

    Lets a batch be written with one join and no per-record copy of the part.
    """
    tail = REC_TAIL.pack(RECORD_MAGIC, 0, queue_id, queue_offset, position, store_ts_ms,
                         len(topic_bytes))
    crc = zlib.crc32(topic_bytes, zlib.crc32(part, zlib.crc32(tail)))
    total = REC_HEADER_SIZE + len(part) + len(topic_bytes)
    return _U32x2.pack(total, crc) + tail, topic_bytes


def build_record(
    topic_bytes: bytes, queue_id: int, queue_offset: int, position: int, store_ts_ms: int,
    part: bytes | memoryview,
) -> bytes:
    """Build a stored record around a message part."""
    head, trailer = build_record_parts(topic_bytes, queue_id, queue_offset, position,
                                       store_ts_ms, part)
    return b"".join((head, part, trailer))


@dataclass(slots=True)
class RecordHead:
    """What storage needs from a record: where it belongs and how to index it."""

    size: int
    queue_id: int
    queue_offset: int
    position: int
    store_ts_ms: int
    topic: str
    unique_key: bytes
    tags_hash: int
    dedup_key: bytes = b""
    count: int = 1  # messages in the record (a batch record's, with the lists below)
    keys: list[bytes] | None = None  # a batch record's dedup keys, one per message
    tag_hashes: list[int] | None = None  # a batch record's tag hashes, one per message

    def messages(self) -> Iterator[tuple[int, bytes, int]]:
        """(queue offset, dedup key, tag hash) of each message of the record."""
        if self.keys is None or self.tag_hashes is None:
            yield self.queue_offset, self.dedup_key, self.tags_hash
            return
        base = self.queue_offset
        for i, key in enumerate(self.keys):
            yield base + i, key, self.tag_hashes[i]

    def holds(self, queue_offset: int) -> bool:
        """Whether the message at ``queue_offset`` is in this record."""
        return self.queue_offset <= queue_offset < self.queue_offset + self.count


def check_record(buf: bytes | memoryview, pos: int, expect_position: int) -> RecordHead:
    """Decode and verify the record at ``buf[pos:]``; raise RecordError if it is not valid.

    ``expect_position`` is the commit-log position the record must claim (a record copied
    elsewhere or left from an older generation does not pass).
    """
    if len(buf) - pos < REC_HEADER_SIZE:
        raise TruncatedRecord("truncated record header")
    total, crc, magic, _r, qid, qoff, rpos, sts, tlen = REC_HEADER.unpack_from(buf, pos)
    if magic == BATCH_RECORD_MAGIC:
        return _check_batch_record(buf, pos, expect_position)
    if magic != RECORD_MAGIC:
        raise RecordError("bad record magic")
    if total < REC_HEADER_SIZE + tlen + MIN_PART_SIZE or total > MAX_RECORD_SIZE:
        raise RecordError("bad record size")
    if len(buf) - pos < total:
        raise TruncatedRecord("truncated record")
    view = memoryview(buf)[pos + 8:pos + total]
    if zlib.crc32(view) != crc:
        raise RecordError("record checksum mismatch")
    if rpos != expect_position:
        raise RecordError("record position mismatch")
    pend = total - 8 - tlen
    topic = bytes(view[pend:]).decode("ascii", "replace")
    key, tags, _blen, uk = check_part(view[REC_HEADER_SIZE - 8:pend])
    return RecordHead(total, qid, qoff, rpos, sts, topic, uk, tag_hash(tags), key)


def _check_batch_record(buf: bytes | memoryview, pos: int, expect_position: int
                        ) -> RecordHead:
    total, crc, _m, _r, qid, base, rpos, sts, tlen = REC_HEADER.unpack_from(buf, pos)
    if total <= REC_HEADER_SIZE + tlen + BATCH_HEAD_SIZE or total > MAX_RECORD_SIZE:
        raise RecordError("bad record size")
    if len(buf) - pos < total:
        raise TruncatedRecord("truncated record")
    view = memoryview(buf)
    bstart = pos + REC_HEADER_SIZE + tlen
    topic_raw = view[pos + REC_HEADER_SIZE:bstart]
    if zlib.crc32(topic_raw, zlib.crc32(view[pos + 8:pos + REC_HEADER_SIZE])) != crc:
        raise RecordError("record checksum mismatch")
    if rpos != expect_position:
        raise RecordError("record position mismatch")
    keys, hashes, _max_body, _flags = check_batch(view[bstart:pos + total])
    topic = bytes(topic_raw).decode("ascii", "replace")
    return RecordHead(total, qid, base, rpos, sts, topic, keys[0], hashes[0], keys[0],
                      len(keys), keys, hashes)


def batch_record_frame_ok(buf: bytes | memoryview, pos: int, total: int) -> bool:
    """Whether the batch record of ``total`` bytes at ``buf[pos:]`` has an intact header
    (its checksum, with the topic) and a batch that fills it exactly: enough to step over
    it without reading its messages."""
    view = memoryview(buf)
    _t, crc, _m, _r, _q, _b, _p, _ts, tlen = REC_HEADER.unpack_from(view, pos)
    bstart = pos + REC_HEADER_SIZE + tlen
    end = pos + total
    if end - bstart < BATCH_HEAD_SIZE or _U32.unpack_from(view, bstart)[0] != end - bstart:
        return False
    return zlib.crc32(view[pos + REC_HEADER_SIZE:bstart],
                      zlib.crc32(view[pos + 8:pos + REC_HEADER_SIZE])) == crc


def _batch_matches(view: memoryview, pos: int, size: int, topic_bytes: bytes,
                   queue_id: int, queue_offset: int, position: int,
                   last_offset: int | None = None) -> bool:
    """``record_matches`` for a batch record: it must hold ``queue_offset`` (and
    ``last_offset``, when index entries up to it point at the record)."""
    total, crc, _m, _r, qid, base, rpos, _ts, tlen = REC_HEADER.unpack_from(view, pos)
    bstart = pos + REC_HEADER_SIZE + tlen
    end = pos + size
    if (total != size or qid != queue_id or rpos != position or tlen != len(topic_bytes)
            or end - bstart < BATCH_HEAD_SIZE or queue_offset < base
            or max(queue_offset, last_offset or 0) >= base + batch_count(view[bstart:end])
            or view[pos + REC_HEADER_SIZE:bstart] != topic_bytes):
        return False
    if zlib.crc32(topic_bytes, zlib.crc32(view[pos + 8:pos + REC_HEADER_SIZE])) != crc:
        return False
    bsize, bcrc = _U32x2.unpack_from(view, bstart)
    return bsize == end - bstart and zlib.crc32(view[bstart + 8:end]) == bcrc


def slice_batch_record(buf: bytes | memoryview, pos: int, first: int, end: int
                       ) -> bytes | None:
    """The checked record at ``buf[pos:]`` cut to its messages in [``first``, ``end``): a
    batch record of which less than half is wanted gets a new batch record of those (its
    own checksums, the same position and store time); None when the record is to be sent
    as it is (the reader keeps the messages wanted: at most as many again are sent for
    nothing, and cutting costs more than sending them)."""
    total, _c, magic, _r, qid, base, rpos, sts, tlen = REC_HEADER.unpack_from(buf, pos)
    if magic != BATCH_RECORD_MAGIC:
        return None
    view = memoryview(buf)
    bstart = pos + REC_HEADER_SIZE + tlen
    count = batch_count(view[bstart:])
    a, b = max(first - base, 0), min(end - base, count)
    if 2 * (b - a) >= count or a >= b:
        return None
    sub = slice_batch(view[bstart:pos + total], a, b)
    return build_batch_record_head(bytes(view[pos + REC_HEADER_SIZE:bstart]), qid, base + a,
                                   rpos, sts, len(sub)) + sub


def record_first_offset(buf: bytes | memoryview, pos: int) -> int:
    """The queue offset of the first message of the record at ``buf[pos:]``."""
    return REC_HEADER.unpack_from(buf, pos)[5]


def record_end_offset(buf: bytes | memoryview, pos: int) -> int:
    """The queue offset after the last message of the (checked) record at ``buf[pos:]``."""
    _t, _c, magic, _r, _q, qoff, _p, _ts, tlen = REC_HEADER.unpack_from(buf, pos)
    if magic != BATCH_RECORD_MAGIC:
        return qoff + 1
    return qoff + batch_count(memoryview(buf)[pos + REC_HEADER_SIZE + tlen:])


def record_matches(buf: bytes | memoryview, pos: int, size: int, topic_bytes: bytes,
                   queue_id: int, queue_offset: int, position: int) -> bool:
    """Whether ``buf[pos:pos+size]`` is the intact record an index entry promises.

    Checks the size, the magic, the queue, offset and position the record claims, its topic
    and its checksum: a record read through a stale or damaged index entry never passes.
    """
    if size < REC_HEADER_SIZE or len(buf) - pos < size:
        return False
    total, crc, magic, _r, qid, qoff, rpos, _ts, tlen = REC_HEADER.unpack_from(buf, pos)
    if magic == BATCH_RECORD_MAGIC:
        return _batch_matches(memoryview(buf), pos, size, topic_bytes, queue_id,
                              queue_offset, position)
    if (total != size or magic != RECORD_MAGIC or qid != queue_id or qoff != queue_offset
            or rpos != position or tlen != len(topic_bytes)):
        return False
    view = memoryview(buf)
    if view[pos + size - tlen:pos + size] != topic_bytes:
        return False
    return zlib.crc32(view[pos + 8:pos + size]) == crc


def first_mismatch(buf: bytes, picked: list[tuple[int, int, int]], topic_bytes: bytes,
                   queue_id: int, lasts: list[int] | None = None) -> int:
    """Index in ``picked`` ((offset, position, size) of consecutive records in ``buf``) of
    the first record that is not what its index entry promises; -1 when all are. (A batch
    record's offset is any offset it holds; ``lasts``: the last offset whose index entry
    points at each record, which a batch record must hold too.)"""
    unpack = REC_HEADER.unpack_from
    crc32 = zlib.crc32
    view = memoryview(buf)
    tlen = len(topic_bytes)
    n = len(buf)
    p = 0
    for i, (off, pos, size) in enumerate(picked):
        end = p + size
        if size < REC_HEADER_SIZE or end > n:
            return i
        total, crc, magic, _r, qid, qoff, rpos, _ts, tl = unpack(buf, p)
        if magic == BATCH_RECORD_MAGIC:
            if not _batch_matches(view, p, size, topic_bytes, queue_id, off, pos,
                                  lasts[i] if lasts is not None else None):
                return i
            p = end
            continue
        if (total != size or magic != RECORD_MAGIC or qid != queue_id or qoff != off
                or rpos != pos or tl != tlen or buf[end - tlen:end] != topic_bytes
                or crc32(view[p + 8:end]) != crc):
            return i
        p = end
    return -1


_NO_TAG_HASH = tag_hash("")  # the hash of a message without tags


def decode_records(buf: bytes | memoryview, verify: bool = True, first: int = 0,
                   end: int | None = None, tag_hashes: frozenset[int] | None = None
                   ) -> Iterator[MessageExt]:
    """Decode concatenated stored records (a pull payload) into messages.

    A pull answers whole batch records, which may hold messages before the pulled offset,
    at or after the pull's next offset, or with tags the pull did not ask for: of a batch
    record's messages, only those with an offset in [``first``, ``end``) and (when
    ``tag_hashes`` is given) a tag hash in it are decoded. Single records are all decoded
    (the broker picked each of them).

    Raises RecordError (and nothing else) on a record that does not decode.
    """
    mv = memoryview(buf)
    n = len(mv)
    pos = 0
    unpack = REC_HEAD_AND_PART.unpack_from
    head_size = REC_HEADER_SIZE + PART_FIXED_SIZE
    crc32 = zlib.crc32
    topic_raw = b""
    topic = ""
    while pos < n:
        if n - pos < REC_HEADER_SIZE:
            raise RecordError("truncated record header")
        if mv[pos + 8] == BATCH_RECORD_MAGIC:
            pos = yield from _decode_batch_record(mv, pos, verify, first, end, tag_hashes)
            continue
        if n - pos < head_size:
            raise RecordError("truncated record header")
        (total, crc, magic, _r, qid, qoff, rpos, sts, tlen,
         born, flags, recons, ulen, tgl, kl, pl, bl) = unpack(mv, pos)
        rec_end = pos + total
        if (magic != RECORD_MAGIC or rec_end > n
                or total != head_size + ulen + tgl + kl + pl + bl + tlen):
            raise RecordError("malformed record")
        if verify and crc32(mv[pos + 8:rec_end]) != crc:
            raise RecordError("record checksum mismatch")
        try:
            p = pos + head_size
            uk, tags, keys, props, body = variable_fields(mv, p, ulen, tgl, kl, pl, bl)
            raw_topic = mv[rec_end - tlen:rec_end]
            if raw_topic != topic_raw:
                topic_raw = bytes(raw_topic)
                topic = topic_raw.decode("ascii")
        except Exception as exc:  # a corrupt record read without verification
            raise RecordError(f"undecodable record: {exc}") from None
        if type(props) is not dict:
            raise RecordError("record properties are not a map")
        yield MessageExt(topic, qid, qoff, body, uk, tags, keys, props, born, sts, recons,
                         flags, rpos)
        pos = rec_end


def variable_fields(mv: memoryview, p: int, ulen: int, tgl: int, kl: int, pl: int, bl: int
            ) -> tuple[str, str, str, Any, bytes]:
    """The variable fields of a message part whose fixed header ends at ``p``."""
    uk = str(mv[p:p + ulen], "ascii")
    p += ulen
    tags = str(mv[p:p + tgl], "utf-8") if tgl else ""
    p += tgl
    keys = str(mv[p:p + kl], "utf-8") if kl else ""
    p += kl
    props = msgpack.unpackb(mv[p:p + pl], raw=False) if pl else {}
    p += pl
    return uk, tags, keys, props, bytes(mv[p:p + bl])


def _decode_batch_record(mv: memoryview, pos: int, verify: bool, first: int,
                         end: int | None, tag_hashes: frozenset[int] | None
                         ) -> Iterator[MessageExt]:
    """The selected messages of the batch record at ``mv[pos:]``; returns its end."""
    total, crc, _m, _r, qid, base, rpos, sts, tlen = REC_HEADER.unpack_from(mv, pos)
    rec_end = pos + total
    bstart = pos + REC_HEADER_SIZE + tlen
    if rec_end > len(mv) or rec_end - bstart < BATCH_HEAD_SIZE:
        raise RecordError("malformed record")
    bsize, bcrc, _bm, _attrs, count = BATCH_HEAD.unpack_from(mv, bstart)
    if bsize != rec_end - bstart:
        raise RecordError("malformed record batch")
    crc32 = zlib.crc32
    if verify and (crc32(mv[bstart + 8:rec_end]) != bcrc or crc32(
            mv[pos + REC_HEADER_SIZE:bstart], crc32(mv[pos + 8:pos + REC_HEADER_SIZE])) != crc):
        raise RecordError("record checksum mismatch")
    lo = max(first - base, 0)
    hi = count if end is None else min(end - base, count)
    if lo >= hi:
        return rec_end
    plain = plain_batch(bytes(mv[bstart:rec_end]))  # slices of bytes: no view per field
    try:
        topic = str(mv[pos + REC_HEADER_SIZE:bstart], "ascii")
    except UnicodeDecodeError:
        raise RecordError("undecodable record batch topic") from None
    (born, flags, recons, _uls, tgls, kls, pls, _bls), uks, starts = columns(plain, count)
    if not b"".join(uks[lo:hi]).isascii():
        raise RecordError("undecodable record: unique key is not ascii")
    shared = BatchColumns(topic, qid, base, sts, rpos, plain, born, flags, recons, uks, starts)
    if not (any(tgls) or any(kls) or any(pls)):  # no tags, keys, properties: all lazy
        if tag_hashes is None or _NO_TAG_HASH in tag_hashes:
            yield from map(BatchMessage, repeat(shared, hi - lo), range(lo, hi))
        return rec_end
    for i in range(lo, hi):
        tgl, kl, pl = tgls[i], kls[i], pls[i]
        if not (tgl or kl or pl):
            if tag_hashes is None or _NO_TAG_HASH in tag_hashes:
                yield BatchMessage(shared, i)
            continue
        q = starts[i]
        try:
            _u, tags, keys, props, body = variable_fields(memoryview(plain), q, 0, tgl, kl, pl,
                                                  starts[i + 1] - q - tgl - kl - pl)
        except Exception as exc:  # a corrupt record read without verification
            raise RecordError(f"undecodable record: {exc}") from None
        if type(props) is not dict:
            raise RecordError("record properties are not a map")
        if tag_hashes is not None and tag_hash(tags) not in tag_hashes:
            continue
        yield MessageExt(topic, qid, base + i, body, uks[i].decode("ascii"), tags, keys, props,
                         born[i], sts, recons[i], flags[i], rpos)
    return rec_end
