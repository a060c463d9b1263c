"""Property: random byte flips and zeroed ranges in older segments lose only the records
they overlap (a record batch: all its messages); every other acknowledged message is
readable at its offset after restart.

Older segments are the ones a restart does not scan (below the checkpoint after a clean
shutdown) or scans as the tail (after a crash): both are drawn. The offline verifier must
name exactly the lost offsets too.
"""

from __future__ import annotations

import os
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceq.log.batch import encode_batch
from onceq.log.record import REC_HEADER_SIZE, encode_part
from onceq.log.segment import FILE_HEADER_SIZE
from onceq.storage.verify import verify_store
from tests.fault.test_integrity import crash, open_store, read_queue, segments

TOPICS = {"A": 3, "B": 2}


def _workload(root: str, seed: int, crashed: bool, batches: bool = False):
    """Send until four segments hold records; return {(topic, q, offset): (uk, pos, end)},
    where [pos, end) is the record that holds the message. ``batches``: producers' record
    batches of 1 to 7 messages (a damaged byte costs the whole batch)."""
    store = open_store(root)
    for t, n in TOPICS.items():
        store.create_topic(t, n)
    acked = {}
    i = 0
    while len(store.log.segments) < 4 or store.log.segments[-1].size < 2000:
        topic = "AB"[(i * 7 + seed) % 2]
        q = (i * 5 + seed) % TOPICS[topic]
        k = 1 + (i + seed) % 7 if batches else 1
        uks = [f"U{i + j:06d}" for j in range(k)]
        parts = [encode_part(bytes([(i + j) % 251]) * (200 + ((i + j) * 37 + seed) % 500),
                             uk, 1) for j, uk in enumerate(uks)]
        if batches:
            batch = encode_batch(parts)
            r = store.put_batch(topic, q, batch)
            size = REC_HEADER_SIZE + len(topic) + len(batch)
        else:
            r = store.put(topic, q, parts)
            size = REC_HEADER_SIZE + len(topic) + len(parts[0])
        for uk, off in zip(uks, r.offsets, strict=True):
            acked[(topic, q, off)] = (uk, r.end_position - size, r.end_position)
        i += k
        if crashed and i == 150 + seed % 200:
            store.write_checkpoint()
    if crashed:
        crash(store)
    else:
        store.close()
    return acked


damage_st = st.lists(
    st.tuples(st.sampled_from(["flip", "zero"]), st.integers(0, 2),  # which older segment
              st.floats(0, 1), st.integers(1, 300)),
    min_size=1, max_size=4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1000), crashed=st.booleans(), damages=damage_st,
       batches=st.booleans())
def test_damage_in_older_segments_costs_only_the_records_it_overlaps(seed, crashed, damages,
                                                                     batches):
    with tempfile.TemporaryDirectory() as root:
        acked = _workload(root, seed, crashed, batches)
        segs = segments(root)
        original = {}
        for path in segs[:3]:
            with open(path, "rb") as f:
                original[path] = f.read()
        for kind, si, where, length in damages:
            path = segs[si]
            data_size = os.path.getsize(path) - FILE_HEADER_SIZE
            at = FILE_HEADER_SIZE + int(where * (data_size - 1))
            n = 1 if kind == "flip" else min(length, data_size + FILE_HEADER_SIZE - at)
            with open(path, "r+b") as f:
                f.seek(at)
                before = f.read(n)
                f.seek(at)
                f.write(bytes([before[0] ^ 0xA5]) if kind == "flip" else bytes(n))
        changed: list[int] = []  # commit-log positions whose byte changed
        for path, old in original.items():
            base = int(os.path.basename(path))
            with open(path, "rb") as f:
                new = f.read()
            changed += [base + i - FILE_HEADER_SIZE for i in range(FILE_HEADER_SIZE, len(old))
                        if old[i] != new[i]]
        lost = {k for k, (_uk, a, b) in acked.items() if any(a <= p < b for p in changed)}

        report = verify_store(root)
        assert report.damaged == bool(lost)
        assert {(d.topic, d.queue_id, o) for d in report.queues
                for o in range(d.first, d.last + 1)} == lost

        for _restart in range(2):  # the damage found stays known after another restart
            store = open_store(root)
            for t, n in TOPICS.items():
                for q in range(n):
                    got, bad = read_queue(store, t, q)
                    mine = {o for (tt, qq, o) in acked if (tt, qq) == (t, q)}
                    assert store.min_max(t, q) == (0, len(mine))
                    assert {(t, q, o) for o in bad} == {k for k in lost if k[:2] == (t, q)}
                    assert set(got) == {o for o in mine if (t, q, o) not in lost}
                    for o, m in got.items():
                        assert m.unique_key == acked[(t, q, o)][0]
                        assert m.position == acked[(t, q, o)][1]
            store.close()
