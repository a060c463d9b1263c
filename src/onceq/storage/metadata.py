"""Small JSON state files written atomically (temp file, fsync, rename, fsync dir)."""

from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Any


def write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def save_json(path: str, value: Any) -> None:
    write_atomic(path, json.dumps(value, indent=1, sort_keys=True).encode())


def load_json(path: str, default: Any) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return default
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: corrupt state file ({exc})") from None


_CHECKPOINT = struct.Struct("<qI")


def encode_checkpoint(position: int) -> bytes:
    raw = struct.pack("<q", position)
    return _CHECKPOINT.pack(position, zlib.crc32(raw))


def decode_checkpoint(raw: bytes) -> int | None:
    """The indexed-up-to position, or None for a missing or damaged checkpoint."""
    if len(raw) != _CHECKPOINT.size:
        return None
    position, crc = _CHECKPOINT.unpack(raw)
    if zlib.crc32(struct.pack("<q", position)) != crc or position < 0:
        return None
    return position
