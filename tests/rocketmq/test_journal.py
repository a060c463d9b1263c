"""The journal of RocketMQ consumption (acknowledgements above the committed offsets, the
generation reserve, the receipt key) across a restart, and onceq's allocation of queues
among PushConsumers."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from onceq.rocketmq.journal import FILE, RESERVE_BLOCK, PopJournal, load_key


def test_acks_and_generations_survive_a_reopen(tmp_path: Path):
    j = PopJournal(str(tmp_path), sync=False)
    j.open(lambda g, t, q: -1)
    assert j.first_generation == 1
    for g in (1, 2):  # generations issued
        j.reserve(g)
    asyncio.run(j.ack(("g", "t", 0), 7))
    asyncio.run(j.ack(("g", "t", 0), 9))
    asyncio.run(j.ack(("g", "t", 1), 3))
    j.close()  # as a killed process leaves it: no compaction at the end
    with open(tmp_path / FILE, "ab") as f:
        f.write(b'["a", "g", "t", 1')  # a torn last write
    j2 = PopJournal(str(tmp_path), sync=False)
    j2.open(lambda g, t, q: 8 if q == 0 else -1)  # the group committed 8 on queue 0
    assert j2.acked == {("g", "t", 0): {9}, ("g", "t", 1): {3}}
    assert j2.first_generation > RESERVE_BLOCK  # past every generation issued before
    assert j2.is_acked(("g", "t", 0), 9) and not j2.is_acked(("g", "t", 0), 7)
    j2.prune(("g", "t", 0), 10)
    j2.forget(("g", "t", 1))
    assert j2.acked == {}
    j2.close()
    j3 = PopJournal(str(tmp_path), sync=False)
    j3.open(lambda g, t, q: -1)
    assert j3.acked == {}  # compacted when forgotten
    j3.close()


def test_receipt_key_is_kept(tmp_path: Path):
    key = load_key(str(tmp_path))
    assert load_key(str(tmp_path)) == key and len(key) == 32
    assert os.stat(tmp_path / "rocketmq_receipt.key").st_mode & 0o077 == 0
