"""The offsets journal record and snapshot formats (pure functions)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceq.log.offset_record import (
    GroupDeleted,
    OffsetCommit,
    OffsetRecordError,
    commit_part,
    decode_commit,
    decode_offset_record,
    decode_snapshot,
    encode_commit,
    encode_group_deleted,
    encode_snapshot,
)
from onceq.log.record import check_part

names = st.text("ABCXYZabcxyz0189_-.%|", min_size=1, max_size=127)
commits = st.builds(OffsetCommit, names, names, st.integers(0, 2 ** 32 - 1),
                    st.integers(0, 2 ** 63 - 1))


@given(commits)
def test_commit_round_trip(c):
    assert decode_commit(encode_commit(c)) == c


@given(st.binary(max_size=300))
def test_arbitrary_bytes_decode_to_a_commit_or_raise_the_format_error(raw):
    try:
        c = decode_commit(raw)
    except OffsetRecordError:
        return
    assert encode_commit(c) == raw  # anything accepted is exactly one encoding


@given(commits, st.data())
def test_every_cut_of_a_record_is_refused(c, data):
    raw = encode_commit(c)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(OffsetRecordError):
        decode_commit(raw[:cut])
    with pytest.raises(OffsetRecordError):
        decode_commit(raw + b"\0")


@given(st.one_of(commits, st.builds(GroupDeleted, names)))
def test_journal_record_round_trip(r):
    raw = encode_commit(r) if isinstance(r, OffsetCommit) else encode_group_deleted(r)
    assert decode_offset_record(raw) == r


@given(st.binary(max_size=300))
def test_arbitrary_bytes_decode_to_a_journal_record_or_raise_the_format_error(raw):
    try:
        r = decode_offset_record(raw)
    except OffsetRecordError:
        return
    again = encode_commit(r) if isinstance(r, OffsetCommit) else encode_group_deleted(r)
    assert again == raw  # anything accepted is exactly one encoding


@given(st.builds(GroupDeleted, names), st.data())
def test_every_cut_of_a_group_deletion_is_refused(d, data):
    raw = encode_group_deleted(d)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(OffsetRecordError):
        decode_offset_record(raw[:cut])
    with pytest.raises(OffsetRecordError):
        decode_offset_record(raw + b"\0")
    with pytest.raises(OffsetRecordError):
        encode_group_deleted(GroupDeleted(""))


def test_unknown_version_and_bad_values_are_refused():
    raw = bytearray(encode_commit(OffsetCommit("g", "t", 1, 2)))
    raw[0] = 2
    with pytest.raises(OffsetRecordError, match="version"):
        decode_commit(bytes(raw))
    with pytest.raises(OffsetRecordError):
        encode_commit(OffsetCommit("", "t", 0, 0))
    with pytest.raises(OffsetRecordError):
        encode_commit(OffsetCommit("g", "t", 0, -1))


def test_commit_part_is_a_valid_message_without_unique_key():
    part = commit_part(OffsetCommit("g", "t", 3, 7), 1234)
    dedup_key, tags, body_size, uk = check_part(part)
    assert uk == b"" and dedup_key == b"" and tags == b""  # no dedup window entry
    assert body_size == len(encode_commit(OffsetCommit("g", "t", 3, 7)))


groups = st.dictionaries(names, st.dictionaries(names, st.dictionaries(
    st.integers(0, 1023).map(str), st.integers(0, 2 ** 62)), max_size=3), max_size=3)


@given(groups, st.integers(0, 2 ** 40))
def test_snapshot_round_trip(g, covered):
    assert decode_snapshot(json.loads(encode_snapshot(g, covered))) == (g, covered)


def test_first_snapshot_format_covers_nothing():
    old = {"g": {"t": {"0": 5}}, "format": {"t": {"1": 2}}}  # a group may be named format
    assert decode_snapshot(old) == (old, 0)


@pytest.mark.parametrize("raw", [
    [], {"format": 3, "covered": 0, "groups": {}}, {"format": 2, "covered": -1, "groups": {}},
    {"format": 2, "covered": 0, "groups": {"g": 5}}, {"g": {"t": {"0": "x"}}},
])
def test_malformed_snapshots_are_refused(raw):
    with pytest.raises(ValueError):
        decode_snapshot(raw)
