"""The dedup journal's chunk format: encode, decode, and what a torn or damaged file
gives back (only the chunks before the first that does not check)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from onceq.storage.dedup_journal import decode_chunks, encode_chunk

WIDTHS = (20, 4, 2, 8, 8)


def chunk(n: int, seed: int) -> tuple[dict, list[bytes]]:
    meta = {"entries": n, "start": seed, "end": seed + 1, "full": False, "secret": "00"}
    cols = [bytes((seed + i) % 256 for i in range(n * w)) for w in WIDTHS]
    return meta, cols


sizes = st.lists(st.integers(min_value=0, max_value=20), min_size=1, max_size=6)


@given(sizes=sizes)
def test_chunks_round_trip(sizes):
    parts = [chunk(n, i) for i, n in enumerate(sizes)]
    data = b"".join(encode_chunk(m, c) for m, c in parts)
    got, used = decode_chunks(data)
    assert used == len(data)
    assert [(m, [bytes(x) for x in c]) for m, c in got] == parts


@given(sizes=sizes, cut=st.integers(min_value=0), flip=st.booleans())
def test_a_torn_or_damaged_chunk_ends_the_file(sizes, cut, flip):
    encoded = [encode_chunk(*chunk(n, i)) for i, n in enumerate(sizes)]
    data = b"".join(encoded)
    at = cut % len(data)
    # one byte changed, or the file ends early
    data = data[:at] + bytes([data[at] ^ 0x41]) + data[at + 1:] if flip else data[:at]
    got, used = decode_chunks(data)
    whole = 0  # chunks that end before the damaged or missing byte
    p = 0
    for e in encoded:
        if p + len(e) > at:
            break
        p += len(e)
        whole += 1
    assert len(got) == whole and used == p


def test_garbage_is_no_chunk():
    assert decode_chunks(b"\x00" * 100) == ([], 0)
    assert decode_chunks(b"") == ([], 0)
