"""Message and commit-log record formats (pure functions, standard library only).

A *message part* is what a producer encodes and sends; the broker stores it verbatim inside
a *record*, behind a fixed header that it fills in (queue, offsets, store time, checksum).
A pull returns stored records verbatim, so the consumer decodes the same format. All field
lengths sit in fixed headers, so one ``struct`` call reads a whole record head.

Message part (little endian)::

    i64 born_ts_ms
    u16 flags
    u16 reconsume_times
    u8  unique key length     (ascii)
    u16 tags length           (utf-8)
    u16 keys length           (utf-8, space separated)
    u32 properties length     (msgpack map str -> str)
    u32 body length
    ... unique key, tags, keys, properties, body

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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

RECORD_MAGIC = 0xA2
REC_HEADER = struct.Struct("<IIBBHqqqB")
REC_HEADER_SIZE = REC_HEADER.size  # 37
PART_FIXED = struct.Struct("<qHHBHHII")
PART_FIXED_SIZE = PART_FIXED.size  # 25
REC_HEAD_AND_PART = struct.Struct("<IIBBHqqqBqHHBHHII")  # both fixed headers in one read
MIN_PART_SIZE = PART_FIXED_SIZE
MAX_RECORD_SIZE = 64 * 1024 * 1024
_U32 = struct.Struct("<I")

_packb = msgpack.Packer(use_bin_type=True).pack


class RecordError(ValueError):
    """A record or message part that does not decode."""


class TruncatedRecord(RecordError):
    """The buffer ends inside the record: more bytes may complete it."""


def tag_hash(tags: str | bytes) -> int:
    """Hash stored in the consume-queue index for broker-side tag filtering (0: no tag)."""
    if not tags:
        return 0
    if isinstance(tags, str):
        tags = tags.encode()
    return zlib.crc32(tags) or 1


def encode_part(
    body: bytes,
    unique_key: str,
    born_ts_ms: int,
    tags: str = "",
    keys: str = "",
    properties: Mapping[str, str] | None = None,
    flags: int = 0,
    reconsume_times: int = 0,
) -> bytes:
    """Encode one message part as a producer sends it."""
    try:
        uk = unique_key.encode("ascii")
    except UnicodeEncodeError:
        raise RecordError("unique key must be ascii") from None
    tg = tags.encode() if tags else b""
    ks = keys.encode() if keys else b""
    pr = _packb(dict(properties)) if properties else b""
    if len(uk) > 255:
        raise RecordError("unique key longer than 255 bytes")
    if len(tg) > 65535 or len(ks) > 65535:
        raise RecordError("tags or keys longer than 65535 bytes")
    head = PART_FIXED.pack(born_ts_ms, flags, reconsume_times, len(uk), len(tg), len(ks),
                           len(pr), len(body))
    return b"".join((head, uk, tg, ks, pr, body))


def check_part(part: bytes | memoryview) -> tuple[bytes, bytes, int, bytes]:
    """Validate a message part; return (dedup key, tags, body size, unique key).

    Raises RecordError when the lengths do not add up exactly to the part's size, or when a
    field would not decode on the consumer side (non-ascii unique key, non-utf-8 tags or
    keys, properties that are not a msgpack map): a stored part must never poison the
    pulls of its queue. (A plain tuple: this runs once per stored message.)

    The dedup key is the unique key, suffixed with the reconsume count when it is not 0: a
    producer retry repeats it, a consumer retry of the same message does not.
    """
    n = len(part)
    if n < PART_FIXED_SIZE:
        raise RecordError("message part too short")
    _born, _flags, recons, ulen, tlen, klen, plen, blen = PART_FIXED.unpack_from(part)
    if PART_FIXED_SIZE + ulen + tlen + klen + plen + blen != n:
        raise RecordError("message part lengths do not match its size")
    p = PART_FIXED_SIZE + ulen
    uk = bytes(part[PART_FIXED_SIZE:p])
    if not uk.isascii():
        raise RecordError("unique key is not ascii")
    tags = b""
    if tlen or klen or plen:
        tags = bytes(part[p:p + tlen])
        p += tlen
        try:
            if tlen:
                tags.decode()
            if klen:
                bytes(part[p:p + klen]).decode()
        except UnicodeDecodeError:
            raise RecordError("tags or keys are not utf-8") from None
        p += klen
        if plen:
            try:
                props = msgpack.unpackb(part[p:p + plen], raw=False)
            except Exception:  # msgpack raises several types
                raise RecordError("properties are not msgpack") from None
            if not isinstance(props, dict):
                raise RecordError("properties are not a map")
    return (b"%s#%d" % (uk, recons) if recons else uk), tags, blen, uk


def part_unique_key_and_tags(part: bytes | memoryview) -> tuple[bytes, bytes, int]:
    """Validate a message part and return (unique_key, tags, body_size)."""
    _key, tags, blen, uk = check_part(part)
    return uk, tags, blen


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


def check_record(buf: bytes | memoryview, pos: int, expect_position: int) -> RecordHead:
    """Decode and verify the record at ``buf[pos:]``; raise RecordError if it is not valid.

    ``expect_position`` is the commit-log position the record must claim (a record copied
    elsewhere or left from an older generation does not pass).
    """
    if len(buf) - pos < REC_HEADER_SIZE:
        raise TruncatedRecord("truncated record header")
    total, crc, magic, _r, qid, qoff, rpos, sts, tlen = REC_HEADER.unpack_from(buf, pos)
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


def record_matches(buf: bytes | memoryview, pos: int, size: int, topic_bytes: bytes,
                   queue_id: int, queue_offset: int, position: int) -> bool:
    """Whether ``buf[pos:pos+size]`` is the intact record an index entry promises.

    Checks the size, the magic, the queue, offset and position the record claims, its topic
    and its checksum: a record read through a stale or damaged index entry never passes.
    """
    if size < REC_HEADER_SIZE or len(buf) - pos < size:
        return False
    total, crc, magic, _r, qid, qoff, rpos, _ts, tlen = REC_HEADER.unpack_from(buf, pos)
    if (total != size or magic != RECORD_MAGIC or qid != queue_id or qoff != queue_offset
            or rpos != position or tlen != len(topic_bytes)):
        return False
    view = memoryview(buf)
    if view[pos + size - tlen:pos + size] != topic_bytes:
        return False
    return zlib.crc32(view[pos + 8:pos + size]) == crc


def first_mismatch(buf: bytes, picked: list[tuple[int, int, int]], topic_bytes: bytes,
                   queue_id: int) -> int:
    """Index in ``picked`` ((offset, position, size) of consecutive records in ``buf``) of
    the first record that is not what its index entry promises; -1 when all are."""
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
        if (total != size or magic != RECORD_MAGIC or qid != queue_id or qoff != off
                or rpos != pos or tl != tlen or buf[end - tlen:end] != topic_bytes
                or crc32(view[p + 8:end]) != crc):
            return i
        p = end
    return -1


@dataclass(slots=True)
class MessageExt:
    """A stored message as a consumer sees it (RocketMQ's name; ``onceq.Message`` is what a
    producer sends)."""

    topic: str
    queue_id: int
    queue_offset: int
    body: bytes
    unique_key: str
    tags: str = ""
    keys: str = ""
    properties: dict[str, Any] = field(default_factory=dict)
    born_ts_ms: int = 0
    store_ts_ms: int = 0
    reconsume_times: int = 0
    flags: int = 0
    position: int = -1

    @property
    def key_list(self) -> list[str]:
        return self.keys.split()


def decode_records(buf: bytes | memoryview, verify: bool = True) -> Iterator[MessageExt]:
    """Decode concatenated stored records (a pull payload) into messages.

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
        if n - pos < head_size:
            raise RecordError("truncated record header")
        (total, crc, magic, _r, qid, qoff, rpos, sts, tlen,
         born, flags, recons, ulen, tgl, kl, pl, bl) = unpack(mv, pos)
        end = pos + total
        if (magic != RECORD_MAGIC or end > n
                or total != head_size + ulen + tgl + kl + pl + bl + tlen):
            raise RecordError("malformed record")
        if verify and crc32(mv[pos + 8:end]) != crc:
            raise RecordError("record checksum mismatch")
        try:
            p = pos + head_size
            uk = str(mv[p:p + ulen], "ascii")
            p += ulen
            tags = str(mv[p:p + tgl], "utf-8") if tgl else ""
            p += tgl
            keys = str(mv[p:p + kl], "utf-8") if kl else ""
            p += kl
            props = msgpack.unpackb(mv[p:p + pl], raw=False) if pl else {}
            p += pl
            body = bytes(mv[p:p + bl])
            p += bl
            raw_topic = mv[p:end]
            if raw_topic != topic_raw:
                topic_raw = bytes(raw_topic)
                topic = topic_raw.decode("ascii")
        except Exception as exc:  # a corrupt record read without verification
            raise RecordError(f"undecodable record: {exc}") from None
        if type(props) is not dict:
            raise RecordError("record properties are not a map")
        yield MessageExt(topic, qid, qoff, body, uk, tags, keys, props, born, sts, recons,
                         flags, rpos)
        pos = end
