"""Messages of a pulled record batch read lazily (log/message.py): every field read equals
what was sent, a lazy message equals, pickles and copies as the eager ``MessageExt`` of the
same fields, and only messages without tags, keys or properties are lazy."""

from __future__ import annotations

import copy
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from onceq.log.batch import build_batch_record_head, encode_batch
from onceq.log.message import BatchMessage, MessageExt, field_values
from onceq.log.record import decode_records, encode_part

msg_st = st.fixed_dictionaries({
    "body": st.binary(max_size=200),
    "key": st.text(alphabet="0123456789ABCDEF", min_size=1, max_size=40),
    "tags": st.sampled_from(["", "", "", "a"]),
    "keys": st.sampled_from(["", "", "", "k1 k2"]),
    "props": st.sampled_from([None, None, None, {"x": "1"}]),
    "recons": st.sampled_from([0, 0, 3]),
    "flags": st.sampled_from([0, 1]),
})


def _record(msgs: list[dict], compression: str, base: int) -> bytes:
    parts = [encode_part(m["body"], m["key"], 1_000 + i, m["tags"], m["keys"], m["props"],
                         flags=m["flags"], reconsume_times=m["recons"])
             for i, m in enumerate(msgs)]
    batch = encode_batch(parts, compression)
    return build_batch_record_head(b"T", 2, base, 4_096, 5_000, len(batch)) + batch


def _eager(m: dict, i: int, base: int) -> MessageExt:
    return MessageExt("T", 2, base + i, m["body"], m["key"], m["tags"], m["keys"],
                      m["props"] or {}, 1_000 + i, 5_000, m["recons"], m["flags"], 4_096)


@given(st.lists(msg_st, min_size=2, max_size=30), st.sampled_from(["none", "zstd", "lz4"]),
       st.data())
@settings(max_examples=150, deadline=None)
def test_a_field_read_lazily_equals_the_field_sent(msgs: list[dict], compression: str,
                                                    data: st.DataObject) -> None:
    base = 40
    rec = _record(msgs, compression, base)
    first = data.draw(st.integers(base, base + len(msgs) - 1))
    end = data.draw(st.integers(first + 1, base + len(msgs)))
    got = list(decode_records(rec, True, first, end))
    want = [_eager(m, i, base) for i, m in enumerate(msgs) if first <= base + i < end]
    del rec  # the messages keep what they need of the pulled bytes
    assert [field_values(m) for m in got] == [field_values(w) for w in want]
    for m, w, sent in zip(got, want, msgs[first - base:end - base], strict=True):
        plain = not (sent["tags"] or sent["keys"] or sent["props"])
        assert isinstance(m, BatchMessage) is plain
        assert m == w and w == m and (m != w) is False
        assert m.body == sent["body"] and type(m.body) is bytes
        assert m.key_list == sent["keys"].split()
        back = pickle.loads(pickle.dumps(m))
        assert type(back) is MessageExt and back == w
        assert copy.copy(m) == w and copy.deepcopy(m) == w


def test_a_lazy_message_keeps_what_is_written_into_its_properties() -> None:
    msgs = [{"body": b"b%d" % i, "key": f"K{i}", "tags": "", "keys": "", "props": None,
             "recons": 0, "flags": 0} for i in range(3)]
    got = list(decode_records(_record(msgs, "none", 0)))
    assert all(isinstance(m, BatchMessage) for m in got)
    got[1].properties["seen"] = "yes"
    assert got[1].properties == {"seen": "yes"} and got[0].properties == {}
    assert got[1] != _eager(msgs[1], 1, 0)  # the map written is part of its fields
    assert "BatchMessage(topic='T', queue_id=2, queue_offset=1" in repr(got[1])


def test_a_lazy_message_is_not_equal_to_another_message() -> None:
    msgs = [{"body": b"same", "key": "K", "tags": "", "keys": "", "props": None, "recons": 0,
             "flags": 0}] * 2
    a, b = decode_records(_record(msgs, "none", 0))
    assert a != b  # offsets differ
    assert a != "not a message"
