"""The dedup window's journal: what a start after a crash reads instead of the log.

Rebuilding a window of 2 million keys from the commit log reads and checks every record of
the window's stretch of log (seconds). So at every checkpoint the window's new entries
(42 bytes a key) are appended to a journal file as one chunk, and a start reads the chunks
back (``DedupWindow.restore``) and then only the log after the last one.

A chunk is a head (magic, length of the JSON meta, crc32 of the rest), the JSON meta and the
five columns of ``DedupWindow.export``. Its meta says which stretch of log it covers:
``start`` (where the chunk before it ended) and ``end`` (a checkpoint position). Rules:

* a chunk is appended after the checkpoint at its ``end`` was written, so every record
  below ``end`` had been fsynced; at start a chunk counts only if it checks, continues the
  chain (same ``start`` as the previous ``end``, same key secret) and its ``end`` is at or
  below the checkpoint and the log's end. The chain stops at the first one that does not;
* a ``full`` chunk holds the whole window and begins a chain anew: it is written when a
  journal begins (at the first checkpoint after a start, or after a failed append), into a
  new file, and the older files are deleted once it is written;
* a new file is also begun when the current one holds ``max_keys`` entries or its first
  entry is older than the window. The file before it then holds every entry the window
  may still need from before, so the files older than that one are deleted, and a chain
  may begin at the first chunk of the oldest file kept.

The journal is a cache of what the log holds: it is not fsynced (a chunk torn by a power cut
does not check, and the log is read from the chain's end instead) and any damage costs
only time.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from dataclasses import dataclass

from .dedup import COLUMN_WIDTHS, DedupWindow
from .files import FileOps

log = logging.getLogger("onceq.storage")

_MAGIC = b"ONCEQDJ1"
_HEAD = struct.Struct("<8sII")  # magic, length of the JSON meta, crc32 of meta + columns
_SUFFIX = ".journal"


def encode_chunk(meta: dict, columns: list[bytes]) -> bytes:
    raw = json.dumps(meta, separators=(",", ":")).encode()
    body = b"".join([raw, *columns])
    return _HEAD.pack(_MAGIC, len(raw), zlib.crc32(body)) + body


def decode_chunks(data: bytes) -> tuple[list[tuple[dict, list[memoryview]]], int]:
    """The chunks of a journal file, up to the first one that does not check, and the
    bytes they take."""
    out = []
    view = memoryview(data)
    p = 0
    while p + _HEAD.size <= len(data):
        magic, meta_len, crc = _HEAD.unpack_from(data, p)
        q = p + _HEAD.size + meta_len
        if magic != _MAGIC or q > len(data):
            break
        try:
            meta = json.loads(bytes(view[p + _HEAD.size:q]))
            n = int(meta["entries"])
        except (ValueError, KeyError, TypeError):
            break
        end = q + n * sum(COLUMN_WIDTHS)
        if end > len(data) or zlib.crc32(view[p + _HEAD.size:end]) != crc:
            break
        cols = []
        for w in COLUMN_WIDTHS:
            cols.append(view[q:q + n * w])
            q += n * w
        out.append((meta, cols))
        p = end
    return out, p


@dataclass
class PendingChunk:
    """A chunk taken from the window on the event loop, appended off it."""

    data: bytes
    start: int | None  # the end of the chunk before it (None: a full chunk)
    end: int
    next_seq: int  # the window's next sequence number when it was taken
    entries: int
    first_ts: int | None  # store time of its oldest entry


class DedupJournal:
    def __init__(self, directory: str, files: FileOps) -> None:
        self.dir = directory
        self.files = files
        self._seq = 0  # the window's entries from this sequence number are not written yet
        self._end: int | None = None  # end of the last chunk written (None: begin anew)
        self._gen = -1  # the file appended to
        self._file_entries = 0
        self._file_first_ts: int | None = None

    def _path(self, gen: int) -> str:
        return os.path.join(self.dir, f"{gen:012d}{_SUFFIX}")

    def _generations(self) -> list[int]:
        try:
            names = self.files.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(int(n[:-len(_SUFFIX)]) for n in names
                      if n.endswith(_SUFFIX) and n[:-len(_SUFFIX)].isdigit())

    # ------------------------------------------------------------------ start
    def load(self, window: DedupWindow, checkpoint: int, log_end: int,
             topics: dict[str, int]) -> int | None:
        """Fill the empty ``window`` from the journal; the log position below which it then
        holds every key (the log from there on is still to be read), or None.

        When the whole journal was used, the next chunk continues it (with the keys that
        the recovery adds from the log); else the next chunk begins it anew."""
        chain: list[list[memoryview]] = []
        meta: dict | None = None
        broken = False
        gens = self._generations()
        if gens:
            self._gen = gens[-1]
        last_file: list[tuple[int, int | None]] = []  # (entries, first ts) of each chunk
        for gen in gens:
            last_file = []
            try:
                data = self.files.read_file(self._path(gen))
            except OSError as exc:
                log.warning("store: cannot read dedup journal file %s: %s", gen, exc)
                broken = True
                continue
            chunks, used = decode_chunks(data)
            for m, cols in chunks:
                if m["end"] > checkpoint or m["end"] > log_end:
                    broken = True
                elif m.get("full") or (meta is None and not broken):
                    # a full chunk, or the oldest kept (files before it were not needed)
                    chain, meta, broken = [cols], m, False
                elif not broken and meta is not None and m["start"] == meta["end"] \
                        and m["secret"] == meta["secret"]:
                    chain.append(cols)
                    meta = m
                else:
                    broken = True
                last_file.append((m["entries"], struct.unpack_from("<q", cols[4])[0]
                                  if m["entries"] else None))
            if used < len(data):  # a chunk that does not check: the chain ends there
                broken = True
        if meta is None:
            return None
        if sum(len(c[1]) for c in chain) and not window.restore(
                meta, [b"".join(c[i] for c in chain) for i in range(len(COLUMN_WIDTHS))],
                topics):
            return None
        if not broken:  # the next chunk goes on from here
            self._end = meta["end"]
            self._seq = window.next_seq
            self._file_entries = sum(n for n, _ts in last_file)
            self._file_first_ts = next((ts for _n, ts in last_file if ts is not None), None)
        return meta["end"]

    # ------------------------------------------------------------------ checkpoints
    def take(self, window: DedupWindow, end: int, topics: dict[str, int]
             ) -> PendingChunk | None:
        """The window's entries not written yet, as a chunk covering the log up to ``end``
        (on the loop, where the window and ``end`` agree); None when nothing changed."""
        if not window.enabled or end == self._end:
            return None
        full = self._end is None
        meta, cols = window.export(0 if full else self._seq, topics)
        meta.update(full=full, start=self._end, end=end)
        n = meta["entries"]
        first_ts = struct.unpack_from("<q", cols[4])[0] if n else None
        return PendingChunk(encode_chunk(meta, cols), self._end, end, window.next_seq, n,
                            first_ts)

    def append(self, chunk: PendingChunk, window_ms: int, max_keys: int,
               now_ms: int) -> None:
        """Write ``chunk`` (off the loop, after the checkpoint at its end was written). A
        failure is logged, and the next chunk begins the journal anew."""
        if chunk.start != self._end:
            return  # taken before a failed append: the next one is full
        full = chunk.start is None
        rotate = full or self._gen < 0 or self._file_entries >= max_keys or (
            self._file_first_ts is not None and self._file_first_ts < now_ms - window_ms)
        gen = self._gen + 1 if rotate else self._gen
        try:
            if rotate:
                self.files.makedirs(self.dir)
            fd = self.files.open(self._path(gen), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                view = memoryview(chunk.data)
                while view:
                    view = view[self.files.write(fd, view):]
            finally:
                self.files.close(fd)
            if rotate:  # a full chunk needs no older file; else the one before is kept
                keep_from = gen if full else gen - 1
                for old in self._generations():
                    if old < keep_from:
                        self.files.unlink(self._path(old))
        except OSError as exc:
            log.error("store: cannot append to the dedup journal: %s; it begins anew at the "
                      "next checkpoint (a crash before then reads the log)", exc)
            self._end = None
            self._gen = gen
            return
        if rotate:
            self._gen = gen
            self._file_entries = 0
            self._file_first_ts = None
        self._file_entries += chunk.entries
        if self._file_first_ts is None:
            self._file_first_ts = chunk.first_ts
        self._seq = chunk.next_seq
        self._end = chunk.end
