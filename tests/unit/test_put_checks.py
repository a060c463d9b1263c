"""The pure pieces of the put path: message checks and the dedup window's key identities."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceq.broker.store_errors import error_code
from onceq.log.record import REC_HEADER_SIZE, encode_part
from onceq.protocol.errors import ErrorCode
from onceq.storage.dedup_keys import DIGEST_KIND, Digests, identities, identity
from onceq.storage.errors import StorageError
from onceq.storage.put import check_parts


def test_check_parts_gives_key_and_tags_of_each_part():
    parts = [encode_part(b"a", "K1", 1, tags="x"), encode_part(b"b", "", 2)]
    assert check_parts(parts, 1, 100, 4096) == [(b"K1", b"x"), (b"", b"")]
    assert check_parts([], 1, 100, 4096) == []


def test_check_parts_refuses_the_batch_for_one_bad_part():
    good = encode_part(b"a", "K1", 1)
    with pytest.raises(StorageError) as e:
        check_parts([good, good[:-1]], 1, 100, 4096)
    assert error_code(e.value) == ErrorCode.BAD_REQUEST
    with pytest.raises(StorageError) as e:
        check_parts([good, encode_part(b"x" * 101, "K2", 1)], 1, 100, 4096)
    assert error_code(e.value) == ErrorCode.MESSAGE_TOO_LARGE
    # the record (header, topic name, part) must fit a segment
    fits = REC_HEADER_SIZE + 5 + len(good)
    assert check_parts([good], 5, 100, fits) == [(b"K1", b"")]
    with pytest.raises(StorageError) as e:
        check_parts([good], 5, 100, fits - 1)
    assert error_code(e.value) == ErrorCode.MESSAGE_TOO_LARGE


keys = st.lists(st.one_of(
    st.binary(max_size=45),
    st.text("0123456789ABCDEF", min_size=40, max_size=40).map(str.encode),
    st.text("0123456789abcdef", min_size=40, max_size=40).map(str.encode),
), max_size=12)


@given(keys=keys, lookup=st.booleans())
def test_batch_identities_match_one_by_one(keys, lookup):
    digest = Digests(b"s" * 16)
    raw, exact, idents = identities(keys, digest, lookup=lookup)
    one = [identity(k, 0, digest) for k in keys]
    want = [b"" if lookup and not k else ident for k, (ident, _t) in zip(keys, one,
                                                                       strict=True)]
    assert list(idents) == want
    want_exact = [tidk & DIGEST_KIND == 0 for _i, tidk in one]
    if exact is None:  # every key exact: their identities end to end
        assert keys and all(want_exact) and raw == b"".join(want)
    else:
        assert raw is None and exact == want_exact
