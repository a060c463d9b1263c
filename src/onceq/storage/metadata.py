"""Small JSON state files written atomically (temp file, fsync, rename, fsync dir)."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import zlib
from typing import Any

from .files import OS_FILES, FileOps


class RenameNotDurable(OSError):
    """``write_atomic`` renamed the new file in place but could not fsync the directory:
    the new content is visible, yet a power cut may bring the old one back."""


def write_atomic(path: str, data: bytes, files: FileOps = OS_FILES) -> None:
    """Replace ``path`` by ``data``: temp file, fsync, rename, fsync of the directory.

    A failure before the rename leaves ``path`` as it was (the temp file is removed when
    possible); a failure of the last fsync raises ``RenameNotDurable``.
    """
    tmp = f"{path}.tmp"
    try:
        fd = files.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            files.write_all(fd, data, 0)
            files.fsync(fd)
        finally:
            files.close(fd)
        files.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            files.unlink(tmp)
        raise
    try:
        files.fsync_dir(os.path.dirname(path) or ".")
    except OSError as exc:
        raise RenameNotDurable(exc.errno, exc.strerror or str(exc)) from exc


def save_json(path: str, value: Any, files: FileOps = OS_FILES) -> None:
    write_atomic(path, json.dumps(value, indent=1, sort_keys=True).encode(), files)


def load_json(path: str, default: Any, files: FileOps = OS_FILES) -> Any:
    try:
        return json.loads(files.read_file(path))
    except FileNotFoundError:
        return default
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: corrupt state file ({exc})") from None


def versioned_doc(raw: bytes, version: int, what: str) -> dict[str, Any]:
    """The JSON object of a state file of ``version``; ValueError naming ``what`` when
    the bytes are not JSON, not an object, or of another version."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("version") != version:
        raise ValueError(f"{what} is not of version {version}")
    return doc


_CHECKPOINT = struct.Struct("<qI")
_CRC = struct.Struct("<I")


def encode_checkpoint(position: int, queue_ends: dict[str, int] | None = None) -> bytes:
    """The checkpoint: the indexed-up-to position, then the queues' next offsets.

    ``queue_ends`` (``"topic/queue" -> next offset``) lets recovery notice an index file
    that lost entries below the checkpoint without scanning the log before it.
    """
    raw = struct.pack("<q", position)
    out = _CHECKPOINT.pack(position, zlib.crc32(raw))
    if queue_ends is not None:
        extra = json.dumps(queue_ends, separators=(",", ":"), sort_keys=True).encode()
        out += extra + _CRC.pack(zlib.crc32(extra))
    return out


def decode_checkpoint(raw: bytes) -> int | None:
    """The indexed-up-to position, or None for a missing or damaged checkpoint."""
    if len(raw) < _CHECKPOINT.size:
        return None
    position, crc = _CHECKPOINT.unpack_from(raw)
    if zlib.crc32(struct.pack("<q", position)) != crc or position < 0:
        return None
    return position


def decode_checkpoint_ends(raw: bytes) -> dict[str, int] | None:
    """The queues' next offsets recorded with the checkpoint (None when absent or damaged)."""
    extra = raw[_CHECKPOINT.size:-_CRC.size]
    if len(raw) <= _CHECKPOINT.size + _CRC.size or _CRC.unpack(raw[-_CRC.size:])[0] != (
            zlib.crc32(extra)):
        return None
    try:
        ends = json.loads(extra)
    except ValueError:
        return None
    return ends if isinstance(ends, dict) else None
