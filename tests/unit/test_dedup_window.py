"""The compact dedup window against a plain-dict reference model.

Any sequence of add / lookup / expire / drop_topic with a fake clock must give the same
answers, the same key count and the same effective window as the model below. The index is
also run with two buckets and a tiny ring, so that long chains, dead and expired links, ring
wrap-around and growth all occur with few keys.
"""

from __future__ import annotations

import logging
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceq.storage import dedup as dedup_mod
from onceq.storage import dedup_ring
from onceq.storage.dedup import DedupWindow


class ModelWindow:
    """The window's semantics in plain Python containers.

    Entries are kept in add order (at most ``max_keys``: the oldest go first, whatever
    their age); a key added again points at its newest entry, and an older entry leaving
    the window no longer removes the key. A dropped topic's keys vanish at once (its
    entries still count against ``max_keys`` until they leave)."""

    def __init__(self, window_s: float, max_keys: int) -> None:
        self.window_ms = int(window_s * 1000)
        self.max_keys = max_keys
        self.gen: dict[str, int] = {}  # topic -> incarnation
        self.next_gen = 0
        self.order: list[tuple[int, int, int, bytes]] = []  # (seq, ts, gen, key)
        self.live: dict[tuple[int, bytes], tuple[int, int, int, int]] = {}
        self.seq = 0
        self.cut: int | None = None

    def _pop(self, now_ms: int, for_cap: bool) -> None:
        seq, ts, g, key = self.order.pop(0)
        if for_cap and ts >= now_ms - self.window_ms:
            self.cut = ts if self.cut is None else max(self.cut, ts)
        v = self.live.get((g, key))
        if v is not None and v[3] == seq:
            del self.live[(g, key)]

    def add(self, topic: str, key: bytes, q: int, off: int, ts: int) -> None:
        if self.max_keys <= 0:
            return
        g = self.gen.get(topic)
        if g is None:
            g = self.gen[topic] = self.next_gen
            self.next_gen += 1
        while len(self.order) >= self.max_keys:
            self._pop(ts, True)
        self.order.append((self.seq, ts, g, key))
        self.live[(g, key)] = (q, off, ts, self.seq)
        self.seq += 1

    def lookup(self, topic: str, key: bytes) -> tuple[int, int, int] | None:
        g = self.gen.get(topic)
        v = None if g is None else self.live.get((g, key))
        return None if v is None else v[:3]

    def expire(self, now_ms: int) -> None:
        while self.order:
            if len(self.order) > self.max_keys:
                self._pop(now_ms, True)
            elif self.order[0][1] < now_ms - self.window_ms:
                self._pop(now_ms, False)
            else:
                break

    def drop_topic(self, topic: str) -> None:
        g = self.gen.pop(topic, None)
        if g is not None:
            for k in [k for k in self.live if k[0] == g]:
                del self.live[k]

    def __len__(self) -> int:
        return len(self.live)

    def effective_window_s(self, now_ms: int) -> float:
        w = self.window_ms
        if self.cut is not None and now_ms - self.cut < w:
            w = max(now_ms - self.cut, 0)
        return w / 1000


TOPICS = ["A", "B", "C"]
# short keys and a consumer retry's key are digested; producer-shaped keys (40 upper-case hex
# digits) are kept exactly; a lower-case or non-hex key of that length is digested
KEYS = [b"", b"k0", b"k1", b"k2", b"k3", b"k1#1",
        b"0A00000100003039BEEF018BCFE6B80000000001", b"0A00000100003039BEEF018BCFE6B80000000002",
        b"0a00000100003039beef018bcfe6b80000000001", b"0A00000100003039BEEF018BCFE6B8000000000Z",
        b"0A00000100003039BEEF018BCFE6B80000000001#1"]

ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.sampled_from(TOPICS), st.sampled_from(KEYS),
              st.integers(0, 7), st.integers(0, 2**40)),
    st.tuples(st.just("batch"), st.lists(st.tuples(
        st.sampled_from(TOPICS), st.sampled_from(KEYS), st.integers(0, 7),
        st.integers(0, 2**40)), max_size=20)),
    st.tuples(st.just("lookup"), st.sampled_from(TOPICS), st.sampled_from(KEYS)),
    # a put's way: all keys looked up at once, then the new ones added (a found key too,
    # when its record is no longer stored: ``stale``)
    st.tuples(st.just("put"), st.sampled_from(TOPICS), st.lists(st.sampled_from(KEYS),
                                                                max_size=20),
              st.integers(0, 7), st.booleans()),
    st.tuples(st.just("expire")),
    st.tuples(st.just("drop"), st.sampled_from(TOPICS)),
    # steps that land exactly on the window's edge (0.5 s, 2 s, 10 s) as well as near it
    st.tuples(st.just("tick"), st.sampled_from([0, 1, 250, 499, 500, 1000, 2000, 10_000])),
), max_size=120)


@pytest.fixture(params=["default", "two-buckets-tiny-ring"])
def layout(request, monkeypatch):
    if request.param != "default":
        monkeypatch.setattr(dedup_ring, "_MAX_BUCKETS", 2)
        monkeypatch.setattr(dedup_mod, "RING_MIN", 2)
    return request.param


def run_and_compare(sequence, window_s: float, max_keys: int) -> None:
    w = DedupWindow(window_s, max_keys)
    m = ModelWindow(window_s, max_keys)
    now = 1_700_000_000_000
    for op in sequence:
        kind = op[0]
        if kind == "add":
            _k, topic, key, q, off = op
            w.add(topic, key, q, off, now)
            m.add(topic, key, q, off, now)
        elif kind == "batch":  # one store time, added at once (small ones key by key)
            w.add_many([(t, k, q, off, now) for t, k, q, off in op[1]])
            for t, k, q, off in op[1]:
                m.add(t, k, q, off, now)
        elif kind == "put":
            _k, topic, keys, q, stale = op
            prevs, found = w.find(topic, keys)
            which: list[int] = []
            seen: set[bytes] = set()
            for i, key in enumerate(keys):
                if not key:
                    continue
                assert prevs[i] == m.lookup(topic, key)
                if (prevs[i] is None or stale) and key not in seen:
                    seen.add(key)
                    which.append(i)
            offsets = [1000 + i for i in which]
            w.add_found(topic, found, which, q, offsets, now)
            for i, off in zip(which, offsets, strict=True):
                m.add(topic, keys[i], q, off, now)
        elif kind == "lookup":
            assert w.get(op[1], op[2]) == m.lookup(op[1], op[2])
        elif kind == "expire":
            w.expire(now)
            m.expire(now)
        elif kind == "drop":
            w.drop_topic(op[1])
            m.drop_topic(op[1])
        else:
            now += op[1]
        assert len(w) == len(m)
        assert w.entries() == len(m.order)
        assert w.effective_window_s(now) == m.effective_window_s(now)
    for topic in TOPICS:
        for key in KEYS:
            assert w.get(topic, key) == m.lookup(topic, key)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(sequence=ops, window_s=st.sampled_from([0.5, 2.0, 10.0]),
       max_keys=st.sampled_from([1, 2, 3, 5, 8, 1000]))
def test_window_matches_model(layout, sequence, window_s, max_keys):
    run_and_compare(sequence, window_s, max_keys)


@pytest.mark.parametrize("seed", range(3))
def test_many_keys_match_model(layout, seed, monkeypatch):
    """Thousands of keys: chains get long (256 buckets), the ring wraps and grows."""
    if layout != "default":
        monkeypatch.setattr(dedup_ring, "_MAX_BUCKETS", 256)
    rnd = random.Random(seed)
    keys = [b"%040X" % rnd.getrandbits(160) for _ in range(2000)]
    keys += [b"k%d" % rnd.getrandbits(64) for _ in range(1000)]
    seq = []
    for _ in range(20_000):
        r = rnd.random()
        if r < 0.4:
            seq.append(("add", rnd.choice(TOPICS), rnd.choice(keys), rnd.randrange(8),
                        rnd.randrange(10**9)))
        elif r < 0.5:  # half of them of producer-shaped keys only (the exact fast path)
            pool = keys if rnd.random() < 0.5 else keys[:2000]
            seq.append(("batch", [(rnd.choice(TOPICS), rnd.choice(pool), rnd.randrange(8),
                                   rnd.randrange(10**9)) for _ in range(rnd.randrange(60))]))
        elif r < 0.6:
            pool = keys if rnd.random() < 0.5 else keys[:2000]
            seq.append(("put", rnd.choice(TOPICS), [rnd.choice(pool) for _ in
                                                    range(rnd.randrange(1, 60))],
                        rnd.randrange(8), rnd.random() < 0.3))
        elif r < 0.8:
            seq.append(("lookup", rnd.choice(TOPICS), rnd.choice(keys)))
        elif r < 0.9:
            seq.append(("tick", rnd.randrange(3)))
        elif r < 0.999:
            seq.append(("expire",))
        else:
            seq.append(("drop", rnd.choice(TOPICS)))
    run_and_compare(seq, 5.0, 4000)


def test_cap_cuts_window_warns_once_a_minute(caplog):
    w = DedupWindow(120, 3)
    now = 1_700_000_000_000
    with caplog.at_level(logging.WARNING, logger="onceq.storage"):
        for i in range(10):
            w.add("T", b"k%d" % i, 0, i, now + i * 1000)
    # keys 7, 8, 9 are kept; key 6, stored 3 s before the last add, was forgotten
    assert w.effective_window_s(now + 9000) == 3.0
    assert len([r for r in caplog.records if "maximum of 3 keys" in r.message]) == 1
    assert w.get("T", b"k7") == (0, 7, now + 7000)
    assert w.get("T", b"k6") is None
    assert w.effective_window_s(now + 6000 + 120_000) == 120.0  # the cut key aged out


def test_disabled_window_holds_nothing():
    w = DedupWindow(120, 0)
    assert not w.enabled
    w.add("T", b"k", 0, 0, 1)
    assert len(w) == 0 and w.get("T", b"k") is None


def test_empty_batches_change_nothing():
    w = DedupWindow(120, 10)
    w.add_many([])
    w.add_columns([], [], [], [], [])
    w.reserve(0)
    assert len(w) == 0 and w.entries() == 0


def _run(w, sequence, now, on_op=None):
    """Apply ``sequence`` to ``w``; ``on_op(i, now)`` after each op. Returns the clock."""
    for i, op in enumerate(sequence):
        if op[0] == "add":
            w.add(op[1], op[2], op[3], op[4], now)
        elif op[0] == "batch":
            w.add_many([(t, k, q, off, now) for t, k, q, off in op[1]])
        elif op[0] == "expire":
            w.expire(now)
        elif op[0] == "drop":
            w.drop_topic(op[1])
        elif op[0] == "tick":
            now += op[1]
        if on_op is not None:
            on_op(i, now)
    return now


def _joined(parts):
    return [b"".join(p[i] for p in parts) for i in range(5)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(sequence=ops, max_keys=st.sampled_from([1, 3, 8, 1000]), dropped=st.sampled_from(
    [None, "A", "B"]))
def test_export_restores_the_same_window(layout, sequence, max_keys, dropped):
    """export then restore (into a fresh window) answers every lookup as the original;
    a topic missing (or created again) at restore finds none of its old keys."""
    w = DedupWindow(2.0, max_keys)
    now = _run(w, sequence, 1_700_000_000_000)
    topics = {t: 7 for t in TOPICS}  # name -> creation position
    later = {**topics, **({dropped: 8} if dropped else {})}  # ``dropped`` created again
    r = DedupWindow(2.0, max_keys)
    meta, cols = w.export(0, topics)
    if not w.entries():
        assert not r.restore(meta, cols, later)
        return
    assert not DedupWindow(3.0, max_keys).restore(meta, cols, later)  # another window
    assert not DedupWindow(2.0, max_keys + 1).restore(meta, cols, later)  # another cap
    assert not DedupWindow(2.0, max_keys).restore(meta, [cols[0][:-1], *cols[1:]], later)
    assert r.restore(meta, cols, later)
    assert r.entries() == w.entries() and r.effective_window_s(now) == w.effective_window_s(now)
    for topic in TOPICS:
        for key in KEYS:
            want = None if topic == dropped else w.get(topic, key)
            assert r.get(topic, key) == want
    assert len(r) == len(w) - (len([k for k in KEYS if w.get(dropped, k)])
                               if dropped else 0)
    # the restored window goes on like the original
    r.add("A", KEYS[1], 1, 99, now)
    r.expire(now + 1_999)
    assert r.get("A", KEYS[1]) == (1, 99, now)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(sequence=ops, max_keys=st.sampled_from([1, 3, 8, 1000]),
       every=st.integers(min_value=1, max_value=40))
def test_chained_exports_restore_every_answer(layout, sequence, max_keys, every):
    """The journal's way: an export of the new entries every few operations, joined at
    restore. Every key the original window answers, the restored one answers the same;
    a key the original forgot (its cap) may still answer, but only with where it really
    was stored."""
    w = DedupWindow(2.0, max_keys)
    topics = {t: 7 for t in TOPICS}
    parts = []
    state = {"seq": 0, "meta": None}
    stored: dict[tuple[str, bytes], set] = {}

    def on_op(i, now):
        if i % every == 0:
            meta, cols = w.export(state["seq"], topics)
            state["seq"] = w.next_seq
            state["meta"] = meta
            parts.append(cols)

    for op in sequence:  # every place each key was stored, for the forgotten ones
        for t, k, q, off in ([op[1:5]] if op[0] == "add" else op[1] if op[0] == "batch"
                             else []):
            stored.setdefault((t, k), set()).add((q, off))
    now = _run(w, sequence, 1_700_000_000_000, on_op)
    meta, cols = w.export(state["seq"], topics)
    parts.append(cols)
    r = DedupWindow(2.0, max_keys)
    if not r.restore(meta, _joined(parts), topics):
        assert not sum(len(p[1]) for p in parts)
        return
    r.expire(now)
    w.expire(now)
    dropped_ever = {op[1] for op in sequence if op[0] == "drop"}
    for topic in TOPICS:
        for key in KEYS:
            want = w.get(topic, key)
            got = r.get(topic, key)
            if want is not None:
                assert got == want
            elif got is not None:
                assert topic in dropped_ever or got[:2] in stored[(topic, key)]
