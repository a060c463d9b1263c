"""CommitLog.scan_segment: resync past damaged bytes, whatever the read chunk size.

Records are written to a real segment, some bytes are changed, and the scan must yield
exactly the records that the changes do not touch, with the bytes between them reported as
damaged ranges. Small read chunks put records and damage across chunk boundaries.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceq.log.record import RecordHead, build_record, encode_part
from onceq.log.segment import FILE_HEADER_SIZE
from onceq.storage import commitlog
from onceq.storage.commitlog import CommitLog


def _write(tmp: str, sizes: list[int]) -> tuple[CommitLog, list[tuple[int, int]]]:
    log = CommitLog(tmp, 1 << 20)
    log.open()
    spans = []
    pos = log.end
    records = []
    for i, n in enumerate(sizes):
        rec = build_record(b"T", 0, i, pos, 1, encode_part(bytes([i % 256]) * n, f"U{i}", 1))
        records.append(rec)
        spans.append((pos, pos + len(rec)))
        pos += len(rec)
    log.write(records)
    return log, spans


@pytest.fixture
def small_chunks(monkeypatch):
    def set_chunk(n: int) -> None:
        monkeypatch.setattr(commitlog, "READ_CHUNK", n)
    return set_chunk


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 700), min_size=1, max_size=40),
       chunk=st.integers(40, 3000),
       changes=st.lists(st.tuples(st.floats(0, 1), st.integers(1, 200), st.booleans()),
                        max_size=4))
def test_scan_yields_every_untouched_record(tmp_path_factory, small_chunks, sizes, chunk,
                                            changes):
    small_chunks(chunk)
    tmp = str(tmp_path_factory.mktemp("seg"))
    log, spans = _write(tmp, sizes)
    seg = log.segments[0]
    total = seg.size
    with open(seg.path, "rb") as f:
        before = f.read()
    with open(seg.path, "r+b") as f:
        for where, n, zero in changes:
            at = int(where * (total - 1))
            n = min(n, total - at)
            f.seek(FILE_HEADER_SIZE + at)
            old = f.read(n)
            f.seek(FILE_HEADER_SIZE + at)
            f.write(bytes(n) if zero else bytes(b ^ 0x3C for b in old))
    with open(seg.path, "rb") as f:
        after = f.read()
    changed = [i - FILE_HEADER_SIZE for i in range(FILE_HEADER_SIZE, len(before))
               if before[i] != after[i]]
    kept = [s for s in spans if not any(s[0] <= c < s[1] for c in changed)]
    got, bad = [], []
    for ev in log.scan_segment(seg):
        if isinstance(ev, RecordHead):
            got.append((ev.position, ev.position + ev.size))
        else:
            bad.append(ev)
    assert got == kept
    # the damaged ranges are exactly the bytes between kept records
    gaps, at = [], 0
    for a, b in kept:
        if a > at:
            gaps.append((at, a))
        at = b
    if at < total:
        gaps.append((at, total))
    assert bad == gaps
    log.close()


def test_scan_tail_truncates_only_a_torn_end(tmp_path):
    log, spans = _write(str(tmp_path), [100] * 10)
    seg = log.segments[0]
    with open(seg.path, "r+b") as f:  # the 4th record damaged, the last one torn
        f.seek(FILE_HEADER_SIZE + spans[3][0] + 20)
        f.write(b"\xff\xff")
        f.truncate(FILE_HEADER_SIZE + spans[9][0] + 50)
    log.close()
    log = CommitLog(str(tmp_path), 1 << 20)
    log.open()
    seen, damage = [], []
    end = log.scan_tail(0, lambda h: seen.append(h.queue_offset),
                        lambda a, b: damage.append((a, b)))
    assert seen == [0, 1, 2, 4, 5, 6, 7, 8]
    assert damage == [spans[3]]
    assert end == spans[8][1] == log.end
    assert os.path.getsize(seg.path) == FILE_HEADER_SIZE + spans[8][1]
    log.close()
