"""File headers of commit-log segments and consume-queue index files (pure)."""

from __future__ import annotations

import struct

LOG_MAGIC = b"ONCQLOG\x00"
INDEX_MAGIC = b"ONCQIDX\x00"
FORMAT_VERSION = 1  # index files
# commit-log segments: 1 holds single records only; 2 may hold batch records too (a
# segment written before batch records existed is read as it is, and the active one is
# marked 2 before it takes a batch record)
LOG_FORMAT_VERSION = 2
_VERSIONS = {LOG_MAGIC: (1, LOG_FORMAT_VERSION), INDEX_MAGIC: (FORMAT_VERSION,)}
FILE_HEADER = struct.Struct("<8sHHIq")  # magic, version, reserved, reserved, base
FILE_HEADER_SIZE = FILE_HEADER.size  # 24

INDEX_ENTRY = struct.Struct("<qIIq")  # position, size, tag hash, store timestamp (ms)
INDEX_ENTRY_SIZE = INDEX_ENTRY.size  # 24
# an index entry of this size marks a damaged offset (no real record is this small); its
# position and timestamp keep the index ordered for the bisections over those fields
DAMAGED_ENTRY_SIZE = 1


def damaged_entry(position: int, store_ts_ms: int) -> bytes:
    """The index entry of an offset whose record was lost to damage."""
    return INDEX_ENTRY.pack(position, DAMAGED_ENTRY_SIZE, 0, store_ts_ms)


class FileHeaderError(ValueError):
    pass


def encode_file_header(magic: bytes, base: int) -> bytes:
    """The header of a new file of this kind (in the newest format version)."""
    return FILE_HEADER.pack(magic, _VERSIONS[magic][-1], 0, 0, base)


def decode_file_header(raw: bytes, magic: bytes, expect_base: int) -> int:
    """The format version of ``raw``, a header of this kind for ``expect_base``; raise
    FileHeaderError when it is not one."""
    if len(raw) < FILE_HEADER_SIZE:
        raise FileHeaderError("file header truncated")
    got_magic, version, _r1, _r2, base = FILE_HEADER.unpack_from(raw)
    if got_magic != magic:
        raise FileHeaderError("bad file magic")
    if version not in _VERSIONS[magic]:
        raise FileHeaderError(f"unsupported file format version {version}")
    if base != expect_base:
        raise FileHeaderError(f"file base {base} does not match its name ({expect_base})")
    return version


def file_name(base: int) -> str:
    return f"{base:020d}"
