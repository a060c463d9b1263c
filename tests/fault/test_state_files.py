"""Damaged or out-of-bounds state files do not keep the store from opening.

* ``offsets.json`` truncated, empty or malformed: logged at ERROR naming the file, and the
  offsets are rebuilt from their journal in the commit log (then saved again).
* ``topics.json`` entries are checked against the bounds of a CREATE_TOPIC request (name,
  1..1024 queues, positions and times >= 0): a bad entry is skipped with an ERROR naming
  it, no directory is created for it, and its index files are left in place.
"""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

from onceq.log.offset_record import OFFSETS_TOPIC
from onceq.log.record import encode_part
from onceq.storage.config import StoreConfig
from onceq.storage.store import MessageStore
from onceq.storage.verify import verify_store
from tests.clock import FakeClock
from tests.helpers import kill_store

T0 = 1_700_000_000.0


def open_store(root: str) -> MessageStore:
    store = MessageStore(StoreConfig(root, segment_size=64 * 1024, index_entries_per_file=100,
                                     max_body=8 * 1024), clock=FakeClock(T0))
    store.open()
    return store


def errors_naming(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.ERROR and name in r.getMessage()]


def _commits(root: str) -> dict:
    """Commits before and after the last snapshot; the store is then killed."""
    store = open_store(root)
    store.create_topic("T", 4)
    for q in range(4):
        store.put("T", q, [encode_part(b"x" * 100, f"U{q}-{i}", 1) for i in range(50)])
    expect = {}
    for step in range(40):
        q, off = step % 4, step + 1
        store.commit_offset("g", "T", q, off)
        expect[("g", q)] = off
        if step == 20:
            store.offsets.save()  # a snapshot covering the first commits
    store.commit_offset("h", "T", 2, 7)
    expect[("h", 2)] = 7
    kill_store(store)
    return expect


DAMAGES = {
    "truncated": lambda raw: raw[: len(raw) // 2],
    "empty": lambda raw: b"",
    "not_json": lambda raw: b"\x00\xff" * 20,
    "not_a_map": lambda raw: b"[1, 2, 3]",
    "bad_covered": lambda raw: json.dumps({"format": 2, "covered": "many",
                                           "groups": {}}).encode(),
    "bad_offset": lambda raw: json.dumps({"format": 2, "covered": 3,
                                          "groups": {"g": {"T": {"0": "ten"}}}}).encode(),
    "negative_offset": lambda raw: json.dumps({"format": 2, "covered": 3,
                                               "groups": {"g": {"T": {"0": -4}}}}).encode(),
    "bad_group_name": lambda raw: json.dumps({"format": 2, "covered": 3,
                                              "groups": {"a/b": {"T": {"0": 4}}}}).encode(),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_offsets_file_is_rebuilt_from_the_journal(tmp_path, caplog, damage):
    root = str(tmp_path)
    expect = _commits(root)
    path = os.path.join(root, "offsets.json")
    with open(path, "rb") as f:
        raw = f.read()
    assert json.loads(raw)["covered"] > 0
    with open(path, "wb") as f:
        f.write(DAMAGES[damage](raw))
    with caplog.at_level(logging.ERROR, logger="onceq"):
        store = open_store(root)
    assert errors_naming(caplog, path), caplog.text
    got = {(g, int(q)): off for g, ts in store.offsets.groups.items() for q, off in ts["T"].items()}
    assert got == expect
    # the snapshot is whole again, covering the journal
    with open(path, "rb") as f:
        snap = json.loads(f.read())
    assert snap["covered"] == store.queues[OFFSETS_TOPIC, 0].max_offset
    store.close()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="onceq"):
        store = open_store(root)
    assert not errors_naming(caplog, path)
    assert {(g, int(q)): off for g, ts in store.offsets.groups.items()
            for q, off in ts["T"].items()} == expect
    store.close()


BAD_TOPICS = {
    "Huge": {"queues": 100_000_000, "created_position": 0, "created_ms": 1},
    "Zero": {"queues": 0, "created_position": 0, "created_ms": 1},
    "Text": {"queues": "8", "created_position": 0, "created_ms": 1},
    "Flag": {"queues": True, "created_position": 0, "created_ms": 1},
    "Back": {"queues": 2, "created_position": -5, "created_ms": 1},
    "Part": {"queues": 2},
    "List": [1, 2],
    "a/b": {"queues": 2, "created_position": 0, "created_ms": 1},
    "..": {"queues": 2, "created_position": 0, "created_ms": 1},
}


def test_out_of_bounds_topic_entries_are_skipped_without_creating_anything(tmp_path, caplog):
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 2)
    store.create_topic("Back", 2)  # a real topic whose entry gets damaged below
    for q in range(2):
        store.put("T", q, [encode_part(b"x", f"U{q}-{i}", 1) for i in range(10)])
        store.put("Back", q, [encode_part(b"y", f"B{q}-{i}", 1) for i in range(3)])
    store.close()
    path = os.path.join(root, "topics.json")
    with open(path) as f:
        table = json.load(f)
    table.update(BAD_TOPICS)
    with open(path, "w") as f:
        json.dump(table, f)
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="onceq"):
        store = open_store(root)
    assert time.monotonic() - t0 < 5
    assert sorted(store.topics) == ["T"]
    assert [store.min_max("T", q) for q in range(2)] == [(0, 10), (0, 10)]
    for name in BAD_TOPICS:
        assert [m for m in errors_naming(caplog, path) if repr(name) in m], name
    # nothing created for a skipped entry; a skipped topic's index files are kept
    assert sorted(os.listdir(os.path.join(root, "queues"))) == ["Back", "T"]
    assert sorted(os.listdir(os.path.join(root, "queues", "Back"))) == ["0", "1"]
    store.create_topic("New", 1)  # a rewrite of the table keeps the skipped entries
    store.close()
    with open(path) as f:
        assert {n: v for n, v in json.load(f).items() if n in BAD_TOPICS} == BAD_TOPICS
    report = verify_store(root)  # the verifier reads the table with the same checks
    assert report.log == [] and report.queues == []
    # the operator repairs the entry: the topic is back with its messages
    with open(path) as f:
        table = json.load(f)
    table["Back"] = {"queues": 2, "created_position": 0, "created_ms": 1}
    with open(path, "w") as f:
        json.dump(table, f)
    store = open_store(root)
    assert [store.min_max("Back", q) for q in range(2)] == [(0, 3), (0, 3)]
    store.close()


@pytest.mark.parametrize("content", [b"", b'{"T": {"queues": 2, "creat', b"[1, 2]", b"\xff\xfe"])
def test_an_unreadable_topics_table_is_rebuilt_from_the_index_directories(
        tmp_path, caplog, content):
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("A", 1)
    store.put("A", 0, [encode_part(b"old", "OLD", 1)])
    store.delete_topic("A")
    store.create_topic("A", 3)  # an older topic of the same name left a record
    store.create_topic("Empty", 2)
    for q in range(3):
        store.put("A", q, [encode_part(b"x", f"U{q}-{i}", 1) for i in range(4)])
    store.commit_offset("g", "A", 1, 2)
    created = store.topics["A"].created_position
    kill_store(store)
    path = os.path.join(root, "topics.json")
    with open(path, "wb") as f:
        f.write(content)
    with caplog.at_level(logging.ERROR, logger="onceq"):
        store = open_store(root)
    assert errors_naming(caplog, path)
    assert {n: t.queues for n, t in store.topics.items()} == {
        "A": 3, "Empty": 2, OFFSETS_TOPIC: 1}
    assert store.topics["A"].created_position >= created  # the old record stays apart
    assert [store.min_max("A", q) for q in range(3)] == [(0, 4)] * 3
    assert store.get_offset("g", "A", 1) == 2
    store.close()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="onceq"):
        store = open_store(root)  # the rebuilt table was saved
    assert not errors_naming(caplog, path)
    assert sorted(store.topics) == ["%OFFSETS%", "A", "Empty"]
    store.close()


@pytest.mark.parametrize("content", [b"[1, 2]", b'{"log": 5}', b'{"log": [[1]]}',
                                     b'{"queues": {"T": {"x": [[1, 2]]}}}', b"{bad"])
def test_a_malformed_damage_list_does_not_stop_the_store(tmp_path, caplog, content):
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 1)
    store.put("T", 0, [encode_part(b"x", f"U{i}", 1) for i in range(5)])
    store.close()
    path = os.path.join(root, "damaged.json")
    with open(path, "wb") as f:
        f.write(content)
    with caplog.at_level(logging.ERROR, logger="onceq"):
        store = open_store(root)
    assert errors_naming(caplog, path)
    assert store.repair.damaged() == {"log": [], "queues": {}}
    assert store.min_max("T", 0) == (0, 5)
    store.close()
