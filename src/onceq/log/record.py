"""Message and commit-log record formats (pure functions, standard library only).

A *message part* is what a producer encodes and sends; the broker stores it verbatim inside
a *record*, behind a fixed header that it fills in (queue, offsets, store time, checksum).
A pull returns stored records verbatim, so the consumer decodes the same format.

Message part (little endian)::

    i64 born_ts_ms
    u16 flags
    u16 reconsume_times
    u8  len + unique key (ascii)
    u16 len + tags (utf-8)
    u16 len + keys (utf-8, space separated)
    u32 len + properties (msgpack map str -> str)
    u32 len + body

Record::

    u32 total_size      size of the whole record, this field included
    u32 crc32           zlib.crc32 of bytes [8:total_size]
    u8  RECORD_MAGIC
    u8  reserved
    u16 queue_id
    i64 queue_offset
    i64 position        commit-log position of this record
    i64 store_ts_ms
    u8  len + topic (ascii)
    ... message part
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

RECORD_MAGIC = 0xA1
REC_HEADER = struct.Struct("<IIBBHqqqB")
REC_HEADER_SIZE = REC_HEADER.size  # 37
PART_FIXED = struct.Struct("<qHHB")
PART_FIXED_SIZE = PART_FIXED.size  # 13
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
MIN_PART_SIZE = PART_FIXED_SIZE + 2 + 2 + 4 + 4
MAX_RECORD_SIZE = 64 * 1024 * 1024

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
    tg = tags.encode()
    ks = keys.encode()
    pr = _packb(dict(properties)) if properties else b""
    if len(uk) > 255:
        raise RecordError("unique key longer than 255 bytes")
    if len(tg) > 65535 or len(ks) > 65535:
        raise RecordError("tags or keys longer than 65535 bytes")
    return b"".join(
        (
            PART_FIXED.pack(born_ts_ms, flags, reconsume_times, len(uk)),
            uk,
            _U16.pack(len(tg)),
            tg,
            _U16.pack(len(ks)),
            ks,
            _U32.pack(len(pr)),
            pr,
            _U32.pack(len(body)),
            body,
        )
    )


def part_unique_key_and_tags(part: bytes | memoryview) -> tuple[bytes, bytes, int]:
    """Validate a message part and return (unique_key, tags, body_size).

    This is all the broker needs from a part; it raises RecordError when the lengths do not
    add up exactly to the part's size, or when a field would not decode on the consumer side
    (non-ascii unique key, non-utf-8 tags or keys, properties that are not a msgpack map
    with string keys): a stored part must never poison the pulls of its queue.
    """
    n = len(part)
    if n < MIN_PART_SIZE:
        raise RecordError("message part too short")
    ulen = part[12]
    p = PART_FIXED_SIZE + ulen
    uk = bytes(part[PART_FIXED_SIZE:p])
    if p + 2 > n:
        raise RecordError("message part truncated in tags")
    tlen = part[p] | (part[p + 1] << 8)
    p += 2
    tags = bytes(part[p:p + tlen])
    p += tlen
    if p + 2 > n:
        raise RecordError("message part truncated in keys")
    klen = part[p] | (part[p + 1] << 8)
    kstart = p + 2
    p = kstart + klen
    if p + 4 > n:
        raise RecordError("message part truncated in properties")
    plen = _U32.unpack_from(part, p)[0]
    pstart = p + 4
    p = pstart + plen
    if p + 4 > n:
        raise RecordError("message part truncated in body")
    blen = _U32.unpack_from(part, p)[0]
    if p + 4 + blen != n:
        raise RecordError("message part lengths do not match its size")
    if not uk.isascii():
        raise RecordError("unique key is not ascii")
    try:
        if tlen:
            tags.decode()
        if klen:
            bytes(part[kstart:kstart + klen]).decode()
    except UnicodeDecodeError:
        raise RecordError("tags or keys are not utf-8") from None
    if plen:
        try:
            props = msgpack.unpackb(part[pstart:pstart + plen], raw=False)
        except Exception:  # msgpack raises several types
            raise RecordError("properties are not msgpack") from None
        if not isinstance(props, dict):
            raise RecordError("properties are not a map")
    return uk, tags, blen


def build_record(
    topic_bytes: bytes, queue_id: int, queue_offset: int, position: int, store_ts_ms: int,
    part: bytes | memoryview,
) -> bytes:
    """Build a stored record around a message part."""
    total = REC_HEADER_SIZE + len(topic_bytes) + len(part)
    head = REC_HEADER.pack(
        total, 0, RECORD_MAGIC, 0, queue_id, queue_offset, position, store_ts_ms,
        len(topic_bytes),
    )
    crc = zlib.crc32(part, zlib.crc32(topic_bytes, zlib.crc32(memoryview(head)[8:])))
    return b"".join((head[:4], _U32.pack(crc), head[8:], topic_bytes, part))


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
    tstart = REC_HEADER_SIZE
    topic = bytes(view[tstart - 8:tstart - 8 + tlen]).decode("ascii", "replace")
    part = view[tstart - 8 + tlen:]
    uk, tags, _ = part_unique_key_and_tags(part)
    return RecordHead(total, qid, qoff, rpos, sts, topic, uk, tag_hash(tags))


@dataclass(slots=True)
class Message:
    """A stored message as a consumer sees it."""

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


def decode_records(buf: bytes | memoryview, verify: bool = True) -> Iterator[Message]:
    """Decode concatenated stored records (a pull payload) into messages.

    Raises RecordError (and nothing else) on a record that does not decode.
    """
    mv = memoryview(buf)
    n = len(mv)
    pos = 0
    unpack = REC_HEADER.unpack_from
    while pos < n:
        if n - pos < REC_HEADER_SIZE:
            raise RecordError("truncated record header")
        total, crc, magic, _r, qid, qoff, rpos, sts, tlen = unpack(mv, pos)
        end = pos + total
        if magic != RECORD_MAGIC or total < REC_HEADER_SIZE + tlen + MIN_PART_SIZE or end > n:
            raise RecordError("malformed record")
        if verify and zlib.crc32(mv[pos + 8:end]) != crc:
            raise RecordError("record checksum mismatch")
        try:
            msg = _decode_message(mv[:end], pos + REC_HEADER_SIZE, qid, qoff, rpos, sts, tlen)
        except RecordError:
            raise
        except Exception as exc:  # a corrupt record read without verification
            raise RecordError(f"undecodable record: {exc}") from None
        yield msg
        pos = end


def _decode_message(
    mv: memoryview, p: int, qid: int, qoff: int, rpos: int, sts: int, tlen: int
) -> Message:
    """Decode the topic and message part at ``mv[p:]``; the record ends at ``len(mv)``."""
    end = len(mv)
    topic = str(mv[p:p + tlen], "ascii")
    p += tlen
    born, flags, recons, ulen = PART_FIXED.unpack_from(mv, p)
    p += PART_FIXED_SIZE
    uk = str(mv[p:p + ulen], "ascii")
    p += ulen
    tl = mv[p] | (mv[p + 1] << 8)
    p += 2
    tags = str(mv[p:p + tl], "utf-8") if tl else ""
    p += tl
    kl = mv[p] | (mv[p + 1] << 8)
    p += 2
    keys = str(mv[p:p + kl], "utf-8") if kl else ""
    p += kl
    pl = _U32.unpack_from(mv, p)[0]
    p += 4
    props = msgpack.unpackb(mv[p:p + pl], raw=False) if pl else {}
    p += pl
    bl = _U32.unpack_from(mv, p)[0]
    p += 4
    if p + bl != end:
        raise RecordError("record lengths do not match its size")
    if not isinstance(props, dict):
        raise RecordError("record properties are not a map")
    return Message(topic, qid, qoff, bytes(mv[p:end]), uk, tags, keys, props, born, sts, recons,
                   flags, rpos)
