"""The message part: what a producer encodes and sends, stored verbatim by the broker
(pure functions, standard library and msgpack only).

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
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping

import msgpack

PART_FIXED = struct.Struct("<qHHBHHII")
PART_FIXED_SIZE = PART_FIXED.size  # 25
MIN_PART_SIZE = PART_FIXED_SIZE

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
