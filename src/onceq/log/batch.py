"""Record batches: a producer's batch of message parts, sent and stored as one unit
(pure functions, standard library only).

A producer sends a batch; the broker checks it once (its checksum, then the lengths of
every message, as it checks a single message) and appends the bytes it received behind a
header of its own, the *batch record*. A pull returns stored batch records as they are;
message ``i`` of a batch record has queue offset ``base_offset + i``. One consume-queue
entry per message still points at its batch record, so offsets, tag filters, store-time
searches and retention work as for single records.

A batch keeps its messages in columns: the fixed headers of all its message parts
(``part.py``, 25 bytes each), their unique keys, then their other variable fields, message
after message. The fixed headers are read with one ``struct`` call for the whole batch,
the keys (of one length, as a producer makes them) with another, and the lengths add up
(or not) without a step per message.

Batch (little endian; what the producer sends, stored as received)::

    u32 size          size of the whole batch, this field included
    u32 crc32         zlib.crc32 of bytes [8:size]
    u8  BATCH_MAGIC
    u8  attributes    bits 0-1: the compression of the columns (0 none, 1 zstd, 2 lz4
                      frame); other bits 0
    u16 count         messages in the batch, 1..65535
    ... count fixed headers of message parts (i64 born_ts_ms, u16 flags, u16
        reconsume_times, u8 unique key length, u16 tags length, u16 keys length,
        u32 properties length, u32 body length)
    ... the unique keys (ascii), back to back
    ... per message: tags, keys, properties, body
    (the columns compressed as one frame, that states its decompressed size, when the
    attributes say so)

Batch record (the commit log's record for a batch)::

    u32 total_size    size of the whole record, this field included
    u32 crc32         zlib.crc32 of bytes [8:37] and the topic (the batch has its own)
    u8  BATCH_RECORD_MAGIC
    u8  reserved
    u16 queue_id
    i64 base_offset   queue offset of the batch's first message
    i64 position      commit-log position of this record
    i64 store_ts_ms
    u8  topic length  (ascii)
    ... topic
    ... batch
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

from .part import PART_FIXED, PART_FIXED_SIZE, RecordError, check_part, tag_hash

BATCH_MAGIC = 0xB1
BATCH_RECORD_MAGIC = 0xA3
BATCH_HEAD = struct.Struct("<IIBBH")  # size, crc32, magic, attributes, count
BATCH_HEAD_SIZE = BATCH_HEAD.size  # 12
MAX_BATCH_COUNT = 65535
BATCH_REC_TAIL = struct.Struct("<BBHqqqB")  # the record header after total_size and crc32
BATCH_REC_HEADER_SIZE = 8 + BATCH_REC_TAIL.size  # 37, as a single record's header
_BATCH_TAIL = struct.Struct("<BBH")
_U32x2 = struct.Struct("<II")
COMPRESSIONS = {"none": 0, "zstd": 1, "lz4": 2}  # name -> the attributes' codec bits
_CODEC_BITS = 0x03
MAX_PLAIN_SIZE = 64 * 1024 * 1024  # the parts of one batch, decompressed
# what checking a batch tells: its messages' dedup keys and tag hashes, its largest body
# size, the OR of its messages' flags
CheckedBatch = tuple[list[bytes], list[int], int, int]


class CodecUnavailable(RecordError):
    """A batch compressed with a codec that is not installed here: nothing is wrong with
    the batch, and reading it again will not help until the package is installed."""


def _codec(codec: int) -> Any:
    """The module of a compression codec (an optional dependency: the ``compression``
    extra); RecordError when it is unknown, CodecUnavailable when it is not installed."""
    try:
        if codec == 1:
            import zstandard
            return zstandard
        if codec == 2:
            import lz4.frame
            return lz4.frame
    except ImportError:
        name = {1: "zstd", 2: "lz4"}[codec]
        raise CodecUnavailable(f"{name} compression needs the "
                               f"{'zstandard' if codec == 1 else 'lz4'} package (pip install "
                               "'onceq[compression]')") from None
    raise RecordError(f"unknown record batch compression {codec}")


def compress(codec: int, plain: bytes) -> bytes:
    mod = _codec(codec)
    return mod.ZstdCompressor(level=3).compress(plain) if codec == 1 else mod.compress(plain)


def decompress(codec: int, data: bytes | memoryview, limit: int = MAX_PLAIN_SIZE) -> bytes:
    """The parts of a compressed batch; RecordError when they do not decompress, or their
    frame does not state a size up to ``limit`` (nothing larger is ever inflated)."""
    mod = _codec(codec)
    try:
        if codec == 1:
            size = mod.frame_content_size(data)
            if 0 <= size <= limit:
                plain = mod.ZstdDecompressor().decompress(data, max_output_size=limit,
                                                          allow_extra_data=False)
        else:
            size = mod.get_frame_info(data).get("content_size") or -1
            if 0 <= size <= limit:
                plain, used = mod.decompress(data, return_bytes_read=True)
                if used != len(data):
                    raise RecordError("bytes after the compressed frame")
    except Exception as exc:  # each codec raises its own errors
        raise RecordError(f"record batch does not decompress: {exc}") from None
    if not 0 <= size <= limit:
        raise RecordError(f"compressed record batch must state its size, up to {limit} bytes")
    if len(plain) != size:
        raise RecordError("record batch decompressed to another size than it states")
    return plain


def encode_batch(parts: Sequence[bytes], compression: str = "none") -> bytes:
    """The batch of message parts ``parts`` (``encode_part``), as a producer sends it,
    its parts compressed with ``compression`` (``COMPRESSIONS``)."""
    codec = _batch_codec(len(parts), compression)
    if min(map(len, parts)) < PART_FIXED_SIZE:
        raise RecordError("message part too short")
    key_ends = [PART_FIXED_SIZE + p[12] for p in parts]  # byte 12: the unique key's length
    body = b"".join([p[:PART_FIXED_SIZE] for p in parts]
                    + [p[PART_FIXED_SIZE:e] for p, e in zip(parts, key_ends, strict=True)]
                    + [p[e:] for p, e in zip(parts, key_ends, strict=True)])
    return _framed(body, codec, len(parts))


def encode_bodies_batch(bodies: Sequence[bytes], unique_keys: Sequence[str], born_ts_ms: int,
                        compression: str = "none") -> bytes:
    """``encode_batch`` of ``encode_part(body, key, born_ts_ms)`` for each body and key (no
    tags, keys or properties), built column by column: a producer's usual batch."""
    n = len(bodies)
    codec = _batch_codec(n, compression)
    try:
        keys = "".join(unique_keys).encode("ascii")
    except UnicodeEncodeError:
        raise RecordError("unique key must be ascii") from None
    ulens = list(map(len, unique_keys))
    blens = list(map(len, bodies))
    if len(ulens) != n or max(ulens) > 255:
        raise RecordError("one unique key per body, at most 255 bytes long")
    pack = PART_FIXED.pack
    if ulens.count(ulens[0]) == n and blens.count(blens[0]) == n:  # one fixed header
        fixed = pack(born_ts_ms, 0, 0, ulens[0], 0, 0, 0, blens[0]) * n
    else:
        fixed = b"".join([pack(born_ts_ms, 0, 0, u, 0, 0, 0, b)
                          for u, b in zip(ulens, blens, strict=True)])
    return _framed(b"".join((fixed, keys, *bodies)), codec, n)


def _batch_codec(count: int, compression: str) -> int:
    if not 0 < count <= MAX_BATCH_COUNT:
        raise RecordError(f"a record batch holds 1..{MAX_BATCH_COUNT} messages")
    codec = COMPRESSIONS.get(compression)
    if codec is None:
        raise RecordError(f"unknown compression {compression!r} (one of "
                          f"{', '.join(COMPRESSIONS)})")
    return codec


def _framed(body: bytes, codec: int, count: int) -> bytes:
    """A batch of ``count`` messages whose columns are ``body`` (compressed here)."""
    if codec:
        body = compress(codec, body)
    tail = _BATCH_TAIL.pack(BATCH_MAGIC, codec, count)
    crc = zlib.crc32(body, zlib.crc32(tail))
    return b"".join((_U32x2.pack(BATCH_HEAD_SIZE + len(body), crc), tail, body))


def batch_count(batch: bytes | memoryview) -> int:
    """The message count a batch's header claims (not checked)."""
    return BATCH_HEAD.unpack_from(batch)[4]


def check_batch(batch: bytes | memoryview) -> CheckedBatch:
    """Check a batch whole; return its messages' (dedup keys, tag hashes), the largest
    body size and the OR of their flags.

    Raises RecordError when the header, the checksum or any part does not check: the size
    and count must match the parts exactly, and every part must decode on the consumer
    side (``check_part``'s rules), so a stored batch never poisons the pulls of its queue.
    A dedup key is the unique key, suffixed with the reconsume count when it is not 0.
    """
    n = len(batch)
    if n < BATCH_HEAD_SIZE:
        raise RecordError("record batch too short")
    size, crc, magic, attrs, count = BATCH_HEAD.unpack_from(batch)
    if magic != BATCH_MAGIC:
        raise RecordError("bad record batch magic")
    if size != n:
        raise RecordError("record batch size does not match its length")
    if attrs & ~_CODEC_BITS:
        raise RecordError(f"record batch attributes {attrs:#x} are not supported")
    if zlib.crc32(memoryview(batch)[8:]) != crc:
        raise RecordError("record batch checksum mismatch")
    return _scan_columns(plain_batch(batch), count)


def plain_batch(batch: bytes | memoryview) -> bytes:
    """The batch with its parts decompressed (its header as it is)."""
    attrs = batch[9]
    if not attrs & _CODEC_BITS:
        return batch if type(batch) is bytes else bytes(batch)
    view = memoryview(batch)
    return bytes(view[:BATCH_HEAD_SIZE]) + decompress(attrs & _CODEC_BITS,
                                                      view[BATCH_HEAD_SIZE:])


_KEY_SPLITS: dict[tuple[int, int], struct.Struct] = {}  # (key length, n) -> n keys
_FIXED_SPLITS: dict[int, struct.Struct] = {}  # n -> n fixed part headers
_FIXED_FORMAT = PART_FIXED.format.lstrip("<")
_FIXED_FIELDS = len(PART_FIXED.unpack(bytes(PART_FIXED_SIZE)))
_SPLIT_MAX_COUNT = 1024  # larger batches: one call a message (a layout is ~30 bytes a key)
_SPLITS_KEPT = 64


def _splits(cache: dict[Any, struct.Struct], key: Any, fmt: str) -> struct.Struct:
    """The ``struct`` of ``fmt`` (little-endian, no padding), kept in ``cache``."""
    st = cache.get(key)
    if st is None:
        if len(cache) >= _SPLITS_KEPT:
            cache.clear()
        st = cache[key] = struct.Struct("<" + fmt)
    return st


def columns(plain: bytes, count: int
            ) -> tuple[tuple[tuple[int, ...], ...], list[bytes], list[int]]:
    """A batch (decompressed) cut into its columns: the fixed-header fields (born, flags,
    reconsume times, and the lengths of unique key, tags, keys, properties, body) as
    tuples, the unique keys, and where each message's other variable fields start (with
    the end of the last as a final entry). Raises RecordError unless the lengths add up to
    the batch exactly."""
    fixed_end = BATCH_HEAD_SIZE + PART_FIXED_SIZE * count
    if not count or len(plain) < fixed_end:
        raise RecordError(f"record batch too short for {count} messages")
    if count <= _SPLIT_MAX_COUNT:  # all fixed headers in one call, then one slice a field
        st = _splits(_FIXED_SPLITS, count, _FIXED_FORMAT * count)
        flat = st.unpack_from(plain, BATCH_HEAD_SIZE)
        cols = tuple(flat[j::_FIXED_FIELDS] for j in range(_FIXED_FIELDS))
    else:
        cols = tuple(zip(*PART_FIXED.iter_unpack(memoryview(plain)[BATCH_HEAD_SIZE:fixed_end]),
                         strict=True))
    _born, _flags, _recons, ulens, tlens, klens, plens, blens = cols
    keys_end = fixed_end + sum(ulens)
    if keys_end > len(plain):
        raise RecordError(f"record batch claims {count} messages whose lengths do not add "
                          "up to its size")
    u = ulens[0]
    if count <= _SPLIT_MAX_COUNT and ulens.count(u) == count:  # a producer's keys: one call
        keys = list(_splits(_KEY_SPLITS, (u, count), f"{u}s" * count).unpack_from(plain,
                                                                                  fixed_end))
    else:
        at = list(accumulate(ulens, initial=fixed_end))
        keys = [plain[at[i]:at[i + 1]] for i in range(count)]
    sizes = (map(sum, zip(tlens, klens, plens, blens, strict=True))
             if any(tlens) or any(klens) or any(plens) else blens)
    starts = list(accumulate(sizes, initial=keys_end))
    if starts[-1] != len(plain):
        raise RecordError(f"record batch claims {count} messages whose lengths do not add "
                          "up to its size")
    return cols, keys, starts  # type: ignore[return-value]


def _row_part(plain: bytes, keys: list[bytes], starts: list[int], i: int) -> bytes:
    """Message ``i`` of a batch (decompressed) as a single message part."""
    f = BATCH_HEAD_SIZE + PART_FIXED_SIZE * i
    return b"".join((plain[f:f + PART_FIXED_SIZE], keys[i], plain[starts[i]:starts[i + 1]]))


def _scan_columns(plain: bytes, count: int) -> CheckedBatch:
    cols, keys, starts = columns(plain, count)
    _born, flags, recons, _ulens, tlens, klens, plens, blens = cols
    if not b"".join(keys).isascii():
        raise RecordError("unique key is not ascii")
    hashes = [0] * count
    if any(tlens) or any(klens) or any(plens) or any(recons):
        keys = list(keys)
        seen_tags: dict[bytes, int] = {}
        for i in range(count):  # the rare fields: the full single-part check
            if tlens[i] or klens[i] or plens[i] or recons[i]:
                keys[i], tags, _blen, _uk = check_part(_row_part(plain, keys, starts, i))
                th = seen_tags.get(tags)
                if th is None:
                    th = seen_tags[tags] = tag_hash(tags)
                hashes[i] = th
    all_flags = 0
    for f in set(flags):
        all_flags |= f
    return keys, hashes, max(blens), all_flags


# the byte columns of the lengths in a part's fixed header: the unique key's (byte 12), and
# the bytes of the tags, keys, properties and body lengths with their weights
_ULEN_BYTE = 12
_VAR_BYTES = ((13, 1), (14, 256), (15, 1), (16, 256),
              *((17 + k, 1 << (8 * k)) for k in range(4)),
              *((21 + k, 1 << (8 * k)) for k in range(4)))


def _sums(headers: bytes, byte: int, cuts: tuple[int, ...]) -> list[int]:
    """Sums of one byte of the fixed headers over [0, cut) for each cut: the byte column
    taken once, with no step per message."""
    column = headers[byte::PART_FIXED_SIZE]
    return [sum(column[:c]) for c in cuts]


def slice_batch(batch: bytes | memoryview, a: int, b: int) -> bytes:
    """A batch of messages ``a``..``b - 1`` of a checked batch (uncompressed): three
    slices of its columns under a new header, found by sums of the length fields (or by
    products, when all messages have one fixed header, as a producer's batch of equal
    bodies)."""
    plain = plain_batch(batch)
    n = batch_count(plain)
    fixed_end = BATCH_HEAD_SIZE + PART_FIXED_SIZE * n
    headers = plain[BATCH_HEAD_SIZE:fixed_end]
    first = headers[:PART_FIXED_SIZE]
    if headers == first * n:
        u = first[_ULEN_BYTE]
        v = sum(first[i] * w for i, w in _VAR_BYTES)
        key_at, key_end, var_base = fixed_end + a * u, fixed_end + b * u, fixed_end + n * u
        var_at, var_end = var_base + a * v, var_base + b * v
    else:
        ka, kb, kn = _sums(headers, _ULEN_BYTE, (a, b, n))
        key_at, key_end, var_base = fixed_end + ka, fixed_end + kb, fixed_end + kn
        var_at, var_end = var_base, var_base
        for i, w in _VAR_BYTES:
            sa, sb = _sums(headers, i, (a, b))
            var_at += sa * w
            var_end += sb * w
    body = b"".join((headers[PART_FIXED_SIZE * a:PART_FIXED_SIZE * b], plain[key_at:key_end],
                     plain[var_at:var_end]))
    return _framed(body, 0, b - a)


def batch_parts(batch: bytes | memoryview) -> list[bytes]:
    """The messages of a checked batch as single message parts."""
    plain = plain_batch(batch)
    count = batch_count(plain)
    _cols, keys, starts = columns(plain, count)
    return [_row_part(plain, keys, starts, i) for i in range(count)]


def build_batch_record_head(topic_bytes: bytes, queue_id: int, base_offset: int,
                            position: int, store_ts_ms: int, batch_size: int) -> bytes:
    """The header and topic that the broker writes before a checked batch."""
    tail = BATCH_REC_TAIL.pack(BATCH_RECORD_MAGIC, 0, queue_id, base_offset, position,
                               store_ts_ms, len(topic_bytes))
    crc = zlib.crc32(topic_bytes, zlib.crc32(tail))
    total = BATCH_REC_HEADER_SIZE + len(topic_bytes) + batch_size
    return b"".join((_U32x2.pack(total, crc), tail, topic_bytes))
