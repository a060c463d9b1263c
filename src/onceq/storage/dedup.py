"""Broker-side dedup window for producer retries, keyed on (topic, unique key).

A retried send whose unique key was stored within the window gets the first send's result
back, flagged as a duplicate, and stores nothing. The window is rebuilt from the commit log
at start (records carry their unique key and store time), so it survives restarts. Memory is
bounded by ``max_keys``: above it the oldest keys are forgotten first, and the window is
then shorter than configured (``effective_window_s``; a warning is logged).

Compact layout (about 60 bytes per key, no Python object per key):

* each key is a 128-bit keyed BLAKE2b digest of (topic id, dedup key); the digest key is
  random per broker process, so clients cannot aim keys at one hash bucket. Two different
  keys answer "duplicate" for each other only if their digests collide: with 128 bits and
  2 million keys in the window the odds are about 1 in 10^26;
* the entries live in an insertion-ordered ring of parallel ``array`` columns (digest, queue,
  offset, store time, topic id), numbered by a sequence number that only grows; expiry pops
  the oldest entries from the head;
* the index is 256 open-addressing (linear probing) tables of sequence numbers, chosen by
  the digest's low bits; each grows on its own, so a resize never stalls for long.

A topic gets a new id when it is dropped: its entries stay in the ring (they still count
against ``max_keys``, as before) but can no longer be found, and go with their time.
"""

from __future__ import annotations

import logging
import os
import struct
from array import array
from collections.abc import Iterable
from hashlib import blake2b

log = logging.getLogger("onceq.storage")

_SEG_BITS = 8
_NSEG = 1 << _SEG_BITS
_SEG_MASK = _NSEG - 1
_SEG_MIN = 8  # slots of an empty index table (a power of two)
_RING_MIN = 1024  # entries of the ring when first needed
_DIGEST = struct.Struct("<QQ").unpack
_TID = struct.Struct("<I").pack
_WARN_EVERY_MS = 60_000


class TopicTable:
    """Lookups in one topic's part of the window: ``get(key)`` -> (queue, offset, ts_ms)."""

    __slots__ = ("_hasher", "_window")

    def __init__(self, window: DedupWindow, hasher: blake2b | None) -> None:
        self._window = window
        self._hasher = hasher

    def get(self, key: bytes) -> tuple[int, int, int] | None:
        if self._hasher is None:
            return None
        h = self._hasher.copy()
        h.update(key)
        w = self._window
        s = w._find(*_DIGEST(h.digest()))
        if s < 0:
            return None
        return w._queue[s], w._offset[s], w._ts[s]

    def __contains__(self, key: bytes) -> bool:
        return self.get(key) is not None


class DedupWindow:
    __slots__ = ("_base", "_cap", "_cut_ts", "_head", "_hi", "_live", "_lo", "_next_tid",
                 "_offset", "_queue", "_secret", "_seg_used", "_segs", "_tail", "_tid",
                 "_topics", "_ts", "_warned_ms", "max_keys", "window_ms")

    def __init__(self, window_s: float, max_keys: int) -> None:
        self.window_ms = int(window_s * 1000)
        self.max_keys = max_keys
        self._secret = blake2b(digest_size=16, key=os.urandom(16))
        # topic -> (topic id, hasher primed with the id); live keys per topic id
        self._topics: dict[str, tuple[int, blake2b]] = {}
        self._live: dict[int, int] = {}
        self._next_tid = 0
        # the ring: sequence number n is at slot (n - _base) % _cap; live seqs [_head, _tail)
        self._cap = 0
        self._base = self._head = self._tail = 0
        self._lo = array("Q")
        self._hi = array("Q")
        self._queue = array("I")
        self._offset = array("q")
        self._ts = array("q")
        self._tid = array("I")
        # the index: seq + 1 per used slot, 0 when empty
        self._segs = [array("Q", bytes(8 * _SEG_MIN)) for _ in range(_NSEG)]
        self._seg_used = [0] * _NSEG
        self._cut_ts: int | None = None  # store time of the newest key the cap cut early
        self._warned_ms = -_WARN_EVERY_MS

    @property
    def enabled(self) -> bool:
        return self.window_ms > 0 and self.max_keys > 0

    def __len__(self) -> int:
        return sum(self._live.values())

    def entries(self) -> int:
        """Entries held, dropped topics' and replaced copies' included (at most max_keys)."""
        return self._tail - self._head

    # ------------------------------------------------------------------ lookups
    def table(self, topic: str) -> TopicTable:
        """One topic's key table: ``get(key)`` -> (queue_id, offset, ts_ms) or None."""
        t = self._topics.get(topic)
        return TopicTable(self, None if t is None else t[1])

    def _topic(self, topic: str) -> tuple[int, blake2b]:
        t = self._topics.get(topic)
        if t is None:
            tid = self._next_tid
            self._next_tid = (tid + 1) & 0xFFFFFFFF
            h = self._secret.copy()
            h.update(_TID(tid))
            t = self._topics[topic] = (tid, h)
            self._live[tid] = 0
        return t

    def _find(self, lo: int, hi: int) -> int:
        """The ring slot of the live entry with this digest, or -1."""
        seg = self._segs[lo & _SEG_MASK]
        m = len(seg) - 1
        i = (lo >> _SEG_BITS) & m
        base = self._base
        cap = self._cap
        los = self._lo
        while True:
            v = seg[i]
            if not v:
                return -1
            s = (v - 1 - base) % cap
            if los[s] == lo and self._hi[s] == hi:
                return s
            i = (i + 1) & m

    # ------------------------------------------------------------------ changes
    def add(self, topic: str, key: bytes, queue_id: int, offset: int, ts_ms: int) -> None:
        """Remember ``key`` of ``topic`` as stored at (queue_id, offset) at ``ts_ms``.

        A key already there is replaced (its older copy no longer answers). Above
        ``max_keys`` entries the oldest go first, whatever their age."""
        self.add_many(topic, ((key, queue_id, offset, ts_ms),))

    def add_many(self, topic: str, items: Iterable[tuple[bytes, int, int, int]]) -> None:
        """``add`` for many (key, queue_id, offset, ts_ms) of one topic, in store order."""
        if self.max_keys <= 0:
            return
        tid, hasher = self._topic(topic)
        max_keys = self.max_keys
        segs = self._segs
        used = self._seg_used
        for key, queue_id, offset, ts_ms in items:
            h = hasher.copy()
            h.update(key)
            lo, hi = _DIGEST(h.digest())
            while self._tail - self._head >= max_keys:
                self._evict(ts_ms)
            if self._tail - self._head >= self._cap:
                self._grow_ring()
            seq = self._tail
            cap = self._cap
            base = self._base
            los = self._lo
            his = self._hi
            s = (seq - base) % cap  # a free slot: written first, the index may grow
            los[s] = lo
            his[s] = hi
            self._queue[s] = queue_id
            self._offset[s] = offset
            self._ts[s] = ts_ms
            self._tid[s] = tid
            si = lo & _SEG_MASK
            seg = segs[si]
            m = len(seg) - 1
            i = (lo >> _SEG_BITS) & m
            while True:
                v = seg[i]
                if not v:
                    seg[i] = seq + 1
                    self._live[tid] += 1
                    n = used[si] = used[si] + 1
                    if n * 2 > m:
                        self._grow_seg(si)
                    break
                o = (v - 1 - base) % cap
                if los[o] == lo and his[o] == hi:
                    seg[i] = seq + 1  # a newer copy of the key
                    break
                i = (i + 1) & m
            self._tail = seq + 1

    def expire(self, now_ms: int) -> None:
        """Forget the keys stored before the window (and any above ``max_keys``)."""
        limit = now_ms - self.window_ms
        ts = self._ts
        while self._head < self._tail:
            if self._tail - self._head > self.max_keys:
                self._evict(now_ms)
            elif ts[(self._head - self._base) % self._cap] < limit:
                self._pop()
            else:
                break

    def drop_topic(self, topic: str) -> None:
        t = self._topics.pop(topic, None)
        if t is not None:
            del self._live[t[0]]

    def effective_window_s(self, now_ms: int) -> float:
        """Seconds back from ``now_ms`` in which every stored key is still remembered: the
        configured window, or less while keys that young were forgotten for ``max_keys``."""
        w = self.window_ms
        if self._cut_ts is not None and now_ms - self._cut_ts < w:
            w = max(now_ms - self._cut_ts, 0)
        return w / 1000

    # ------------------------------------------------------------------ internals
    def _evict(self, now_ms: int) -> None:
        """Pop the oldest entry for the key cap; note it when it was inside the window."""
        ts = self._ts[(self._head - self._base) % self._cap]
        if ts >= now_ms - self.window_ms:
            if self._cut_ts is None or ts > self._cut_ts:
                self._cut_ts = ts
            if now_ms - self._warned_ms >= _WARN_EVERY_MS:
                self._warned_ms = now_ms
                log.warning("store: the dedup window holds its maximum of %d keys: keys "
                            "stored %.1f s ago are forgotten (window %g s); raise "
                            "--dedup-max-keys to keep the whole window",
                            self.max_keys, (now_ms - ts) / 1000, self.window_ms / 1000)
        self._pop()

    def _pop(self) -> None:
        """Drop the oldest entry of the ring, and its index slot if it is the live copy."""
        seq = self._head
        s = (seq - self._base) % self._cap
        lo = self._lo[s]
        si = lo & _SEG_MASK
        seg = self._segs[si]
        m = len(seg) - 1
        i = (lo >> _SEG_BITS) & m
        want = seq + 1
        while True:
            v = seg[i]
            if not v:
                break  # a replaced copy: the index points at the newer one
            if v == want:
                self._delete(seg, i, m)
                self._seg_used[si] -= 1
                tid = self._tid[s]
                if tid in self._live:  # not a dropped topic's
                    self._live[tid] -= 1
                break
            i = (i + 1) & m
        self._head = seq + 1

    def _delete(self, seg: array, i: int, m: int) -> None:
        """Empty slot ``i`` of a linear-probing table, moving later entries back."""
        base = self._base
        cap = self._cap
        los = self._lo
        j = i
        while True:
            j = (j + 1) & m
            v = seg[j]
            if not v:
                break
            home = (los[(v - 1 - base) % cap] >> _SEG_BITS) & m
            # the entry at j may move to i unless its home lies cyclically in (i, j]
            if (home <= i < j) or (i < j < home) or (j < home <= i):
                seg[i] = v
                i = j
        seg[i] = 0

    def _grow_seg(self, si: int) -> None:
        old = self._segs[si]
        m = len(old) * 2 - 1
        new = array("Q", bytes(8 * (m + 1)))
        base = self._base
        cap = self._cap
        los = self._lo
        for v in old:
            if v:
                i = (los[(v - 1 - base) % cap] >> _SEG_BITS) & m
                while new[i]:
                    i = (i + 1) & m
                new[i] = v
        self._segs[si] = new

    def _grow_ring(self) -> None:
        """Double the ring (up to max_keys), laying it out from the head again."""
        n = self._tail - self._head
        cap = max(min(max(self._cap * 2, _RING_MIN), self.max_keys), n + 1)
        start = (self._head - self._base) % self._cap if self._cap else 0
        for name, code in (("_lo", "Q"), ("_hi", "Q"), ("_queue", "I"), ("_offset", "q"),
                           ("_ts", "q"), ("_tid", "I")):
            old = getattr(self, name)
            new = array(code, old[start:start + n])
            if len(new) < n:
                new.extend(old[:n - len(new)])
            new.extend(array(code, bytes(new.itemsize * (cap - n))))
            setattr(self, name, new)
        self._base = self._head
        self._cap = cap
