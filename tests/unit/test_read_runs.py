"""A pull's pick of records from index entries (storage/reads.py): the pick by runs of
entries equals the pick entry by entry, but for the batch record a pull would cut at its
end after other records, which it leaves to the next pull."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from onceq.log.segment import INDEX_ENTRY
from onceq.storage.reads import _entries_one_by_one, _entry_runs


@st.composite
def index(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """Index entries of records back to back (a run of entries per batch record), and the
    position of each entry's record."""
    pos = draw(st.integers(0, 1000))
    raw, poss = b"", []
    for _ in range(draw(st.integers(1, 12))):
        run = draw(st.sampled_from([1, 1, 2, 5, 10, 30]))
        size = draw(st.integers(40, 3000))
        raw += INDEX_ENTRY.pack(pos, size, 0, 7) * run
        poss += [pos] * run
        pos += size + draw(st.sampled_from([0, 0, 0, 13]))  # another queue's record between
    return raw, poss


@given(index(), st.integers(1, 64), st.integers(1, 40_000), st.integers(0, 10**6))
@settings(max_examples=400, deadline=None)
def test_runs_pick_what_entries_pick_but_a_cut_last_batch(entries: tuple[bytes, list[int]],
                                                          max_msgs: int, max_bytes: int,
                                                          offset: int) -> None:
    raw, poss = entries
    e = INDEX_ENTRY.size
    runs = _entry_runs(raw[:(max_msgs + 1) * e], offset, 0, max_bytes, max_msgs)
    one = _entries_one_by_one(raw[:max_msgs * e], offset, 0, max_bytes, None)
    assert runs is not None and isinstance(one, tuple)
    picked, counts, lasts, ranges, scanned = one
    if (scanned == max_msgs < len(poss) and poss[scanned] == poss[scanned - 1]
            and len(picked) > 1):  # the last record goes on past max_msgs: left to the next
        scanned -= counts[-1]
        picked, counts, lasts = picked[:-1], counts[:-1], lasts[:-1]
        end = picked[-1][1] + picked[-1][2]
        ranges = [[p, min(s, end - p)] for p, s in ranges if p < end]
    assert runs == (picked, counts, lasts, ranges, scanned)
    assert sum(counts) == scanned  # no tag filter: every entry scanned is picked
