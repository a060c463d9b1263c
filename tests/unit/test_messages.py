"""The typed messages of the wire protocol (``protocol/requests.py``, ``replies.py``):
every request and reply survives encode -> msgpack -> decode, a header map of junk is a
clear error and never a crash, and every request code has its request and reply type."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceq.protocol import replies, requests, schema
from onceq.protocol.codes import PullStatus, RequestCode
from onceq.protocol.errors import ErrorCode, OnceqError
from onceq.protocol.frame import decode_header
from onceq.protocol.replies import REPLY_OF, PullReply, SendReply
from onceq.protocol.requests import REQUESTS, GroupBeat, QueueRef

INT64 = st.integers(schema.INT64_MIN, schema.INT64_MAX)
TEXT = st.text(max_size=12)
JSONISH = st.none() | st.booleans() | INT64 | TEXT
BY_PARSER = {
    schema.p_int: INT64, schema.p_str: TEXT, schema.p_bool: st.booleans(),
    schema.p_str_list: st.lists(TEXT, max_size=4), schema.p_int_list: st.lists(INT64, max_size=4),
    schema.p_str_map: st.dictionaries(TEXT, TEXT, max_size=3),
    schema.p_map: st.dictionaries(TEXT, JSONISH, max_size=3),
    schema.p_list: st.lists(JSONISH, max_size=3), schema.p_any: JSONISH,
    requests.p_gen: st.none() | INT64, requests.p_offset: INT64,
    requests.p_seq: st.integers(0, 2 ** 62 - 1),
    requests.p_groups: st.lists(st.builds(
        GroupBeat, TEXT, st.dictionaries(TEXT, TEXT, max_size=2),
        st.sampled_from([requests.CLUSTERING, requests.BROADCASTING]),
        st.none() | st.dictionaries(TEXT, INT64, max_size=2),
        st.none() | st.lists(st.tuples(TEXT, INT64, INT64), max_size=2),
        st.none() | INT64), max_size=3),
    replies.p_status: st.sampled_from(list(PullStatus)),
}
QUEUES = {False: st.lists(st.builds(QueueRef, TEXT, INT64), max_size=3),
          True: st.lists(st.builds(QueueRef, TEXT, INT64,
                                   st.none() | st.integers(0, schema.INT64_MAX)), max_size=3)}


def _strategy(cls: type[schema.Message], spec: schema.Spec) -> st.SearchStrategy:
    if spec.name == "queues" and cls in (requests.LockQueues, requests.UnlockQueues):
        return QUEUES[cls is requests.UnlockQueues]
    if cls is SendReply:  # one reply shape: the offsets, with the duplicates' places
        return st.lists(st.integers(0, 2 ** 40), max_size=4)
    if spec.parse is requests.p_offset or (cls is replies.SequencedReply and spec.name == "base"):
        return st.none() | st.integers(0, schema.INT64_MAX)  # a negative one is none
    base = BY_PARSER[spec.parse]
    return st.none() | base if spec.optional else base


def instances(cls: type[schema.Message]) -> st.SearchStrategy:
    fields = {s.name: _strategy(cls, s) for s in cls.SPECS}
    if cls.HAS_PAYLOAD:
        fields["payload"] = st.binary(max_size=16)
    if cls is SendReply:
        fields["queue"] = st.integers(0, 255)
        fields["dupq"] = st.just([])
        fields["dups"] = st.just([])
    return st.builds(cls, **fields)


def roundtrip(msg: schema.Message) -> schema.Message:
    wire = msgpack.packb(msg.encode(), use_bin_type=True)
    return type(msg).decode(decode_header(wire), getattr(msg, "payload", b""))


ALL = sorted({*REQUESTS.values(), *REPLY_OF.values(), *replies.PUSHES.values()},
             key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_message_survives_encode_and_decode(cls, data):
    msg = data.draw(instances(cls))
    assert roundtrip(msg) == msg


@given(st.lists(st.integers(0, 2 ** 40), min_size=1, max_size=6, unique=True),
       st.lists(st.integers(0, 5), max_size=3, unique=True))
def test_a_send_reply_keeps_every_offset_and_the_duplicates_places(offsets, dup_at):
    dups = sorted(i for i in dup_at if i < len(offsets))
    reply = SendReply(3, offsets, dups, [7] * len(dups))
    back = roundtrip(reply)
    assert back == reply
    assert [back.queue_of(i) for i in range(len(offsets))] == [
        7 if i in dups else 3 for i in range(len(offsets))]


def test_a_contiguous_send_reply_is_sent_as_its_first_offset_and_count():
    assert SendReply(2, [5, 6, 7]).encode() == {"queue": 2, "base": 5, "n": 3}


HEADERS = st.dictionaries(
    st.sampled_from(sorted({s.wire for c in REQUESTS.values() for s in c.SPECS})) | TEXT,
    JSONISH | st.lists(JSONISH, max_size=3) | st.dictionaries(TEXT, JSONISH, max_size=2),
    max_size=8)


@pytest.mark.parametrize("cls", sorted(set(REQUESTS.values()), key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
@settings(max_examples=150, deadline=None)
@given(header=HEADERS)
def test_a_header_of_junk_is_a_clear_error_never_a_crash(cls, header):
    try:
        msg = cls.decode(header, b"")
    except OnceqError as exc:
        assert exc.code in (ErrorCode.INVALID_ARGUMENT, ErrorCode.INVALID_SEQUENCE)
        assert exc.message
    else:
        assert type(msg) is cls


def test_a_missing_or_mistyped_field_is_named_in_the_error():
    with pytest.raises(OnceqError) as err:
        requests.Pull.decode({"topic": "t", "queue": 0})
    assert (err.value.code, err.value.message) == (
        ErrorCode.INVALID_ARGUMENT, "field 'offset' must be an integer")
    with pytest.raises(OnceqError) as err:
        requests.Pull.decode({"topic": "t", "queue": 0, "offset": 1, "max": True})
    assert err.value.message == "field 'max' must be an integer"  # the wire's name
    with pytest.raises(OnceqError) as err:
        requests.CommitOffset.decode({"group": "g", "topic": "t", "queue": 0, "offset": 1 << 63})
    assert "out of range" in err.value.message
    # an optional field may be absent or nil; a field with a default may be absent only
    assert requests.Pull.decode({"topic": "t", "queue": 0, "offset": 1, "group": None}
                                ).group is None
    with pytest.raises(OnceqError):
        requests.Pull.decode({"topic": "t", "queue": 0, "offset": 1, "max": None})


def test_the_wire_keeps_its_short_names():
    pull = requests.Pull("t", 1, 2, max_msgs=5, group="g")
    assert pull.encode() == {"topic": "t", "queue": 1, "offset": 2, "max": 5,
                             "suspend_ms": 0, "group": "g"}
    reply = PullReply(PullStatus.FOUND, 3, 0, 9, 2, payload=b"xy")
    assert reply.encode() == {"st": 0, "next": 3, "min": 0, "max": 9, "n": 2}


def test_every_request_code_has_one_request_and_one_reply_type():
    assert set(REQUESTS) == set(RequestCode) == set(REPLY_OF)
    for code, cls in REQUESTS.items():
        assert code == cls.CODE
        assert dataclasses.is_dataclass(cls) and hasattr(cls, "__slots__")


ALL = sorted({*REQUESTS.values(), *REPLY_OF.values()}, key=lambda c: c.__name__)
GENERATED = [c for c in ALL if getattr(c.decode.__func__, "generated", False)]
WRITTEN = [replies.SendReply, replies.SequencedReply]  # replies with a decoder of their own


def test_every_message_but_two_replies_has_a_generated_decoder():
    assert [c for c in ALL if c not in GENERATED] == WRITTEN


def _outcome(decode, header: dict, payload: bytes) -> object:
    try:
        return decode(header, payload)
    except OnceqError as exc:
        return ("error", exc.code)


@pytest.mark.parametrize("cls", GENERATED, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_generated_decoder_answers_as_the_generic_one(cls, data):
    """Each class decodes with code generated from its fields (it runs for every request):
    on any header map, well-formed or not, it gives what the generic decoder gives."""
    keys = [s.wire for s in cls.SPECS] + ["extra"]
    header = data.draw(st.dictionaries(st.sampled_from(keys), JSONISH | st.lists(INT64),
                                       max_size=len(keys)))
    if data.draw(st.booleans()):  # a well-formed one, with some fields mixed up
        header = {**data.draw(instances(cls)).encode(), **header}
    generic = schema.Message.decode.__func__  # type: ignore[attr-defined]
    assert _outcome(cls.decode, header, b"p") == _outcome(
        lambda h, p: generic(cls, h, p), header, b"p")


@pytest.mark.parametrize("cls", WRITTEN, ids=lambda c: c.__name__)
@settings(max_examples=100, deadline=None)
@given(header=st.dictionaries(st.sampled_from(["queue", "offsets", "dups", "dupq", "base",
                                               "n", "dup", "x"]),
                              JSONISH | st.lists(JSONISH, max_size=3), max_size=6))
def test_a_reply_with_its_own_decoder_refuses_junk_clearly(cls, header):
    try:
        cls.decode(header)
    except OnceqError as exc:
        assert exc.code == ErrorCode.INVALID_ARGUMENT


def test_unique_keys_count_on_across_batches_and_wrap_at_32_bits():
    from onceq.client.message import UniqueKeyGenerator

    g = UniqueKeyGenerator()
    keys = g.many(5) + g.many(1) + [g.next()] + g.many(100)
    assert len(set(keys)) == len(keys) == 107
    assert all(len(k) == 40 and k == k.upper() for k in keys)
    assert [int(k[32:], 16) for k in keys] == list(range(107))
    g._next = 0xFFFFFFFE
    assert [int(k[32:], 16) for k in g.many(4)] == [0xFFFFFFFE, 0xFFFFFFFF, 0, 1]
