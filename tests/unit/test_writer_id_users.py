"""A writer id's user binding lasts while the broker keeps a sequence of that writer or a
connection sends under it: the bindings do not grow without bound."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from onceq import ErrorCode, OnceqError
from onceq.broker.writer_ids import WriterIds


@dataclass(eq=False)
class Conn:
    user: str | None
    closed: bool = False
    peer: str = "peer"
    writer_ids: set[str] = field(default_factory=set)


def test_bindings_of_expired_writers_are_dropped_and_the_id_is_free():
    ids = WriterIds()
    alice = Conn("alice")
    for i in range(1000):
        ids.claim(alice, f"w{i}")
    ids.drop(alice)
    alice.closed = True
    sequences = {(f"w{i}", "T", 0): None for i in range(1000)}
    assert ids.forget_users(sequences, expired=0) == 0  # all still have sequences
    with pytest.raises(OnceqError) as ei:
        ids.claim(Conn("mallory"), "w7")
    assert ei.value.code == ErrorCode.WRITER_IN_USE
    # the writers' sequences expired but w0..w9
    kept = {(f"w{i}", "T", 0): None for i in range(10)}
    assert ids.forget_users(kept, expired=990) == 990
    ids.claim(Conn("bob"), "w500")  # anyone's again
    with pytest.raises(OnceqError):
        ids.claim(Conn("bob"), "w5")  # still alice's


def test_a_binding_in_use_by_an_open_connection_stays():
    ids = WriterIds()
    alice = Conn("alice")
    ids.claim(alice, "w")
    assert ids.forget_users({}, expired=1) == 0  # no sequence yet, but its connection is open
    ids.drop(alice)
    alice.closed = True
    # no expiry pass, yet more bindings than sequences: a failed send left one behind
    assert ids.forget_users({}, expired=0) == 1
