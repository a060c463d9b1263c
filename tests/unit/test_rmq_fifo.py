"""The pure parts of FIFO groups, retries and dead letters on the RocketMQ endpoint: group
settings, message-group placement, the FIFO gate of the in-flight table, and delivery
attempts kept by the journal across a restart."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest

pytest.importorskip("google.protobuf")

from onceq.log.message import MessageExt
from onceq.log.part import check_part
from onceq.log.record import build_record, decode_records
from onceq.rocketmq._pb import definition_pb2 as pb
from onceq.rocketmq.groups import (
    DEFAULT_MAX_ATTEMPTS,
    FILE,
    GroupSettings,
    GroupSettingsFile,
    parse,
    save,
)
from onceq.rocketmq.journal import PopJournal
from onceq.rocketmq.mapping import (
    PROP_MESSAGE_GROUP,
    Code,
    RmqError,
    queue_of,
    to_part,
    to_pb,
)
from onceq.rocketmq.pop import PopTable


def _message(**sp) -> pb.Message:
    m = pb.Message()
    m.topic.name = "orders"
    m.body = b"hello"
    m.system_properties.message_id = sp.pop("message_id", "0102FC000000ABCDEF")
    for k, v in sp.items():
        setattr(m.system_properties, k, v)
    return m


def _stored(part: bytes) -> MessageExt:
    """The part as a consumer would read it back (through a record of the log)."""
    check_part(part)
    return next(decode_records(build_record(b"orders", 2, 9, 5, 1_700_000_000_999, part)))


# ------------------------------------------------------------------ group settings
def test_group_settings_default_to_onceqs_retries():
    assert DEFAULT_MAX_ATTEMPTS == 17  # max_reconsume 16, plus the first delivery
    raw = json.dumps({"version": 1, "groups": {
        "a": {"fifo": True, "max_delivery_attempts": 3, "retry_delays": "1s 5s"},
        "b": {}}}).encode()
    assert parse(raw) == {"a": GroupSettings(True, 3, (1.0, 5.0)), "b": GroupSettings()}


@pytest.mark.parametrize("entry", [
    {"fifo": "yes"}, {"max_delivery_attempts": 0}, {"max_delivery_attempts": True},
    {"retry_delays": "soon"}, {"retry_delays": "500ms"}, {"retry_delays": "1.5s"},
    {"orderly": True},
])
def test_bad_group_settings_are_refused_naming_the_group(entry):
    with pytest.raises(ValueError, match="group 'g'"):
        parse(json.dumps({"version": 1, "groups": {"g": entry}}).encode())


def test_group_settings_file_is_read_again_when_it_changes(tmp_path: Path):
    now = [0.0]
    f = GroupSettingsFile(str(tmp_path), clock=lambda: now[0])
    assert f.get("g") == GroupSettings()  # no file: defaults
    save(str(tmp_path), {"g": {"fifo": True}})
    assert not f.get("g").fifo  # checked at most once a second
    now[0] = 1.5
    assert f.get("g").fifo
    (tmp_path / FILE).write_text("{not json")  # a bad file keeps what was read
    now[0] = 3.0
    assert f.get("g").fifo and f.problem
    os.remove(tmp_path / FILE)
    now[0] = 4.5
    assert f.get("g") == GroupSettings() and not f.problem


# ------------------------------------------------------------------ message groups
def test_message_group_hashes_as_onceqs_sharding_key():
    for group in ("alpha", "customer-7", "ü"):
        for n in (1, 4, 7):
            assert queue_of(group, n) == zlib.crc32(group.encode()) % n


def test_fifo_message_keeps_its_group_and_goes_back_as_fifo():
    m = _message(message_type=pb.FIFO, message_group="customer-7")
    m.user_properties["p"] = "v"
    stored = _stored(to_part(m))
    assert stored.properties == {"p": "v", PROP_MESSAGE_GROUP: "customer-7"}
    out = to_pb(stored, namespace="", receipt="RH", invisible_s=30, attempt=1,
                store_host="h:1")
    assert out.system_properties.message_type == pb.FIFO
    assert out.system_properties.message_group == "customer-7"
    assert dict(out.user_properties) == {"p": "v"}  # the group is not a user property
    plain = to_pb(_stored(to_part(_message())), namespace="", receipt="RH",
                  invisible_s=30, attempt=1, store_host="h:1")
    assert plain.system_properties.message_type == pb.NORMAL
    assert not plain.system_properties.HasField("message_group")


def test_a_user_property_cannot_fake_a_message_group():
    m = _message()
    m.user_properties[PROP_MESSAGE_GROUP] = "forged"
    assert PROP_MESSAGE_GROUP not in _stored(to_part(m)).properties


@pytest.mark.parametrize("kw, code, words", [
    ({"message_type": pb.FIFO}, Code.ILLEGAL_MESSAGE_GROUP, "needs a message group"),
    ({"message_type": pb.FIFO, "message_group": " "}, Code.ILLEGAL_MESSAGE_GROUP,
     "printable"),
    ({"message_type": pb.FIFO, "message_group": "g" * 129}, Code.ILLEGAL_MESSAGE_GROUP,
     "1-128"),
    ({"message_type": pb.DELAY}, Code.ILLEGAL_DELIVERY_TIME, "needs a"),
])
def test_messages_onceq_cannot_store_are_refused_clearly(kw, code, words):
    with pytest.raises(RmqError) as e:
        to_part(_message(**kw))
    assert e.value.code == code and words in e.value.message


# ------------------------------------------------------------------ the FIFO gate
def test_fifo_queue_hands_out_nothing_while_a_delivery_is_invisible():
    t = PopTable()
    t.start("g", "t", 0, -1, 0)
    t.start("g", "t", 1, -1, 0)
    for off in (0, 1, 2):
        t.deliver("g", "t", 0, off, 10, now=0)
    t.deliver("g", "t", 1, 0, 1, now=0)
    q0 = t.queue("g", "t", 0)
    assert q0 is not None and q0.blocked(5)
    assert t.due("g", "t", 5, fifo=True) == [(1, 0)]  # queue 1's is visible again
    # queue 0: some visible again while another is still invisible: nothing of it
    t.change("g", "t", 0, 2, q0.inflight[2].generation, 1, now=5)
    t.change("g", "t", 0, 1, q0.inflight[1].generation, 100, now=5)
    assert (0, 0) not in t.due("g", "t", 20, fifo=True)  # offset 1 is still invisible
    assert (0, 0) in t.due("g", "t", 20, fifo=False)
    # all visible again: redelivered in offset order
    assert t.due("g", "t", 200, fifo=True) == [(0, 0), (0, 1), (0, 2), (1, 0)]


def test_attempts_count_on_from_prior_deliveries():
    t = PopTable()
    t.start("g", "t", 0, -1, 0)
    assert t.deliver("g", "t", 0, 5, 1, now=0, prior=2).attempt == 3
    assert t.deliver("g", "t", 0, 5, 1, now=2, prior=2).attempt == 4  # in flight: +1
    assert t.attempt("g", "t", 0, 5) == 4 and t.attempt("g", "t", 0, 6) == 0


# ------------------------------------------------------------------ the journal
async def test_delivery_attempts_survive_a_restart(tmp_path: Path):
    j = PopJournal(str(tmp_path), sync=False)
    j.open(lambda g, t, q: -1)
    key = ("g", "t", 0)
    j.delivered(key, 4, 1)  # first deliveries are not journaled
    j.delivered(key, 5, 2)
    j.delivered(key, 5, 3)
    j.delivered(key, 6, 2)
    j.delivered(key, 9, 2)
    await j.ack(key, 6)  # settled: its count goes
    j.close()
    j2 = PopJournal(str(tmp_path), sync=False)
    j2.open(lambda g, t, q: 5)  # committed offset 5: the count of 4 (none) and below go
    assert [j2.attempts_of(key, o) for o in (4, 5, 6, 9)] == [0, 3, 0, 2]
    assert j2.is_acked(key, 6)
    j2.prune(key, 9)
    assert j2.attempts_of(key, 5) == 0 and j2.attempts_of(key, 9) == 2
    j2.forget(key)
    assert j2.attempts_of(key, 9) == 0
    j2.close()
