"""Length-prefixed frames, sans I/O.

Layout of one frame (little endian)::

    u32 length        bytes that follow this field
    u8  version       PROTOCOL_VERSION
    u8  kind          REQUEST, RESPONSE or PUSH
    u16 code          request code (REQUEST, PUSH) or error code (RESPONSE)
    u32 corr_id       correlation id; a response echoes its request's id
    u32 header_len    length of the msgpack header map
    ... header        msgpack map (small, control fields)
    ... payload       raw bytes (messages), the rest of the frame

``FrameDecoder`` turns bytes into ``Frame`` objects and raises ``ProtocolError`` for a
stream that cannot be framed (bad version, bad lengths, oversized frame). ``encode_frame``
is the inverse. Neither touches sockets.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from .errors import ErrorCode, ProtocolError

PROTOCOL_VERSION = 1
REQUEST = 0
RESPONSE = 1
PUSH = 2
_KINDS = (REQUEST, RESPONSE, PUSH)

PREFIX = struct.Struct("<IBBHII")
PREFIX_SIZE = PREFIX.size  # 16
_AFTER_LENGTH = PREFIX_SIZE - 4

DEFAULT_MAX_BODY = 4 * 1024 * 1024
HEADER_ALLOWANCE = 64 * 1024


def max_frame_for_body(max_body: int) -> int:
    """The frame length limit that admits one batch of bodies up to ``max_body`` bytes."""
    return max_body + HEADER_ALLOWANCE


_packb = msgpack.Packer(use_bin_type=True).pack


def encode_frame(
    kind: int,
    code: int,
    corr_id: int,
    header: dict[str, Any] | None = None,
    payload: bytes = b"",
) -> bytes:
    return encode_frame_head(kind, code, corr_id, header, len(payload)) + payload


def encode_frame_head(kind: int, code: int, corr_id: int, header: dict[str, Any] | None,
                      payload_len: int) -> bytes:
    """A frame up to its payload: a large payload can then be written after it as it is,
    without being copied into one frame (``transport.writelines``)."""
    hdr = _packb(header) if header else b""
    length = _AFTER_LENGTH + len(hdr) + payload_len
    return PREFIX.pack(length, PROTOCOL_VERSION, kind, code, corr_id, len(hdr)) + hdr


def decode_header(raw: bytes | memoryview) -> dict[str, Any]:
    """Decode a header map; raise ``ProtocolError``-free ``ValueError`` on junk."""
    if not raw:
        return {}
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types
        raise ValueError(f"undecodable header: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("header is not a map")
    return value


class FrameDecoder:
    """Incremental decoder: ``feed(bytes)`` then iterate ``frames()``.

    Headers are returned raw and decoded by the caller with ``decode_header``: a frame whose
    header is junk is still a well-framed frame, so the connection can answer BAD_REQUEST
    and carry on.
    """

    __slots__ = ("_buf", "_max_frame", "broken")

    def __init__(self, max_frame: int = max_frame_for_body(DEFAULT_MAX_BODY)) -> None:
        self._buf = bytearray()
        self._max_frame = max_frame
        self.broken: ProtocolError | None = None

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def frames(self) -> list[tuple[int, int, int, int, bytes, bytes]]:
        """Return complete frames as (version, kind, code, corr_id, header, payload) tuples.

        Raises ProtocolError when the stream cannot be framed; the decoder then stays broken.
        """
        if self.broken is not None:
            raise self.broken
        buf = self._buf
        out: list[tuple[int, int, int, int, bytes, bytes]] = []
        pos = 0
        end = len(buf)
        unpack_from = PREFIX.unpack_from
        while end - pos >= PREFIX_SIZE:
            length, version, kind, code, corr_id, hlen = unpack_from(buf, pos)
            err = None
            if version != PROTOCOL_VERSION:
                err = ProtocolError(
                    ErrorCode.UNSUPPORTED_VERSION, f"protocol version {version} not supported"
                )
            elif length > self._max_frame:
                err = ProtocolError(
                    ErrorCode.FRAME_TOO_LARGE,
                    f"frame of {length} bytes exceeds the limit of {self._max_frame} bytes",
                )
            elif kind not in _KINDS or length < _AFTER_LENGTH or hlen > length - _AFTER_LENGTH:
                err = ProtocolError(ErrorCode.BAD_REQUEST, "malformed frame prefix")
            if err is not None:
                self.broken = err
                err.corr_id = corr_id  # type: ignore[attr-defined]
                del buf[:pos]
                if out:
                    return out
                raise err
            total = 4 + length
            if end - pos < total:
                break
            hstart = pos + PREFIX_SIZE
            pstart = hstart + hlen
            out.append(
                (version, kind, code, corr_id, bytes(buf[hstart:pstart]),
                 bytes(buf[pstart:pos + total]))
            )
            pos += total
        if pos:
            del buf[:pos]
        return out
