"""Broker-side dedup window for producer retries, keyed on (topic, unique key).

A retried send whose unique key was stored within the window gets the first send's result
back, flagged as a duplicate, and stores nothing. The window is rebuilt from the commit log
at start (records carry their unique key and store time), so it survives restarts. Memory is
bounded by ``max_keys``: above it the oldest keys are forgotten first, and the window is
then shorter than configured (``effective_window_s``; a warning is logged).

Compact layout (about 70 bytes per key, no Python object per key):

* each key is kept as a 20-byte identity: the key itself when it has the producer's shape
  (40 upper-case hex digits, stored as their 20 bytes, exact), else a 128-bit BLAKE2b
  digest of the key, keyed with a secret drawn at random per broker process. Two different
  keys answer "duplicate" for each other only if their digests collide: with 128 bits and
  2 million keys in the window the odds are about 1 in 10^26, and no client can aim at
  another's key without the secret;
* the entries live in an insertion-ordered ring of parallel columns (identity, topic id,
  hash, queue, offset, store time), numbered by a sequence number that only grows; expiry
  pops the oldest entries from the head;
* the index is 256 open-addressing (linear probing) tables of sequence numbers, placed by
  Python's per-process randomised hash of the key; each table grows on its own, so a
  resize never stalls for long.

A topic gets a new id when it is dropped: its entries stay in the ring (they still count
against ``max_keys``) but can no longer be found, and go with their time.
"""

from __future__ import annotations

import logging
import os
from array import array
from binascii import unhexlify
from collections import Counter
from collections.abc import Iterable, Sequence
from hashlib import blake2b

log = logging.getLogger("onceq.storage")

_SEG_BITS = 8
_NSEG = 1 << _SEG_BITS
_SEG_MASK = _NSEG - 1
_SEG_MIN = 8  # slots of an empty index table (a power of two)
_RING_MIN = 1024  # entries of the ring when first needed
_IDENT = 20  # bytes of a key's identity in the ring
_HEX_KEY = 2 * _IDENT  # a producer's unique key: 40 upper-case hex digits
_HEX_DIGITS = b"0123456789ABCDEF"
_DIGEST_KIND = 1 << 31  # in the topic-id column: the identity is a digest, not the key
_H32 = 0xFFFFFFFF
_WARN_EVERY_MS = 60_000


class _Digests:
    """128-bit keyed BLAKE2b digests of the keys that are not producer-shaped."""

    __slots__ = ("_copy",)

    def __init__(self) -> None:
        self._copy = blake2b(digest_size=16, key=os.urandom(16)).copy

    def __call__(self, key: bytes) -> bytes:
        h = self._copy()
        h.update(key)
        return h.digest() + b"\0\0\0\0"


def _identity(key: bytes, tid: int, digest: _Digests) -> tuple[bytes, int]:
    """(20-byte identity, topic-id column value) of a key."""
    if len(key) == _HEX_KEY and not key.translate(None, _HEX_DIGITS):
        return unhexlify(key), tid
    return digest(key), tid | _DIGEST_KIND


class TopicTable:
    """Lookups in one topic's part of the window: ``get(key)`` -> (queue, offset, ts_ms)."""

    __slots__ = ("_tid", "_window")

    def __init__(self, window: DedupWindow, tid: int | None) -> None:
        self._window = window
        self._tid = tid

    def get(self, key: bytes) -> tuple[int, int, int] | None:
        tid = self._tid
        if tid is None:
            return None
        w = self._window
        h = hash(key) & _H32
        seg = w._segs[h & _SEG_MASK]
        m = len(seg) - 1
        i = (h >> _SEG_BITS) & m
        v = seg[i]
        if not v:
            return None  # the common case: a new key
        ident, tidk = _identity(key, tid, w._digest)
        base = w._base
        cap = w._cap
        hs = w._hash
        while v:
            s = (v - 1 - base) % cap
            if hs[s] == h and w._tid[s] == tidk and \
                    w._ident[s * _IDENT:s * _IDENT + _IDENT] == ident:
                return w._queue[s], w._offset[s], w._ts[s]
            i = (i + 1) & m
            v = seg[i]
        return None

    def __contains__(self, key: bytes) -> bool:
        return self.get(key) is not None


class DedupWindow:
    __slots__ = ("_base", "_cap", "_cut_ts", "_digest", "_hash", "_head", "_ident", "_live",
                 "_next_tid", "_offset", "_queue", "_seg_used", "_segs", "_tail", "_tid",
                 "_topics", "_ts", "_warned_ms", "max_keys", "window_ms")

    def __init__(self, window_s: float, max_keys: int) -> None:
        self.window_ms = int(window_s * 1000)
        self.max_keys = max_keys
        self._digest = _Digests()
        self._topics: dict[str, int] = {}  # topic -> topic id (a new one after a drop)
        self._live: dict[int, int] = {}  # topic id -> keys that answer
        self._next_tid = 0
        # the ring: sequence number n is at slot (n - _base) % _cap; held seqs [_head, _tail)
        self._cap = 0
        self._base = self._head = self._tail = 0
        self._ident = bytearray()
        self._tid = array("I")
        self._hash = array("I")
        self._queue = array("H")
        self._offset = array("q")
        self._ts = array("q")
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
        return TopicTable(self, self._topics.get(topic))

    def _topic(self, topic: str) -> int:
        tid = self._topics.get(topic)
        if tid is None:
            tid = self._topics[topic] = self._next_tid
            self._next_tid = (tid + 1) % _DIGEST_KIND
            self._live[tid] = 0
        return tid

    # ------------------------------------------------------------------ changes
    def add(self, topic: str, key: bytes, queue_id: int, offset: int, ts_ms: int) -> None:
        """Remember ``key`` of ``topic`` as stored at (queue_id, offset) at ``ts_ms``.

        A key already there is replaced (its older copy no longer answers). Above
        ``max_keys`` entries the oldest go first, whatever their age."""
        self.add_columns([topic], [key], [queue_id], [offset], [ts_ms])

    def add_many(self, items: Iterable[tuple[str, bytes, int, int, int]]) -> None:
        """``add`` for many (topic, key, queue_id, offset, ts_ms), in store order."""
        cols = list(zip(*items, strict=True))
        if cols:
            self.add_columns(*cols)

    def add_columns(self, topics: Sequence[str], keys: Sequence[bytes],
                    queues: Sequence[int], offsets: Sequence[int],
                    ts_ms: Sequence[int]) -> None:
        """``add_many`` with the items as columns (the same length), in store order."""
        max_keys = self.max_keys
        n = len(keys)
        if max_keys <= 0 or not n:
            return
        step = min(n, max_keys)
        for a in range(0, n, step):  # a chunk never evicts its own keys
            b = a + step
            self._add_chunk(topics[a:b], keys[a:b], queues[a:b], offsets[a:b], ts_ms[a:b])

    def _add_chunk(self, topics: Sequence[str], keys: Sequence[bytes],
                   queues: Sequence[int], offsets: Sequence[int],
                   ts_ms: Sequence[int]) -> None:
        k = len(keys)
        known = self._topics
        for t in set(topics):
            if t not in known:
                self._topic(t)
        tids = list(map(known.__getitem__, topics))
        hex_key = _HEX_KEY
        hexdigits = _HEX_DIGITS
        exact = [len(key) == hex_key and not key.translate(None, hexdigits) for key in keys]
        digest = self._digest
        idents = [unhexlify(key) if e else digest(key) for key, e in zip(keys, exact,
                                                                          strict=True)]
        tidks = [t if e else t | _DIGEST_KIND for t, e in zip(tids, exact, strict=True)]
        h32 = _H32
        hashes = [hash(key) & h32 for key in keys]
        # room: the oldest entries go first (the i-th add evicts when the window is full)
        free = self.max_keys - (self._tail - self._head)
        for j in range(max(free, 0), k):
            self._evict(ts_ms[j])
        if self._tail - self._head + k > self._cap:
            self._grow_ring(min(max(self._cap * 2, _RING_MIN, self._tail - self._head + k),
                                max(self.max_keys, k)))
        cap = self._cap
        first = self._tail
        s0 = (first - self._base) % cap
        k1 = min(k, cap - s0)  # up to the ring's end, then from its start
        for s, lo, hi in ((s0, 0, k1), (0, k1, k)):
            if lo == hi:
                continue
            e = s + hi - lo
            self._ident[s * _IDENT:e * _IDENT] = b"".join(idents[lo:hi])
            self._tid[s:e] = array("I", tidks[lo:hi])
            self._hash[s:e] = array("I", hashes[lo:hi])
            self._queue[s:e] = array("H", queues[lo:hi])
            self._offset[s:e] = array("q", offsets[lo:hi])
            self._ts[s:e] = array("q", ts_ms[lo:hi])
        self._tail = first + k
        # the index, entry by entry (a later copy of a key replaces the earlier one)
        segs = self._segs
        used = self._seg_used
        seg_mask, seg_bits = _SEG_MASK, _SEG_BITS
        base = self._base
        hs = self._hash
        ring_tids = self._tid
        ring_idents = self._ident
        width = _IDENT
        live = self._live
        seq = first
        # each table first grows to hold its new keys at a load of at most one half
        per_seg = Counter([h & seg_mask for h in hashes])
        for si, c in per_seg.items():
            c += used[si]
            used[si] = c
            if c * 2 >= len(segs[si]):
                size = len(segs[si]) * 2
                while c * 2 >= size:
                    size *= 2
                self._grow_seg(si, size)
        for t, c in Counter(tids).items():
            live[t] += c
        for j, h in enumerate(hashes):
            seq += 1  # seq + 1 of entry j
            seg = segs[h & seg_mask]
            m = len(seg) - 1
            i = (h >> seg_bits) & m
            v = seg[i]
            while v:
                o = (v - 1 - base) % cap
                if hs[o] == h and ring_tids[o] == tidks[j] and \
                        ring_idents[o * width:o * width + width] == idents[j]:
                    seg[i] = seq  # a newer copy of the key: one key, one slot
                    live[tids[j]] -= 1
                    used[h & seg_mask] -= 1
                    break
                i = (i + 1) & m
                v = seg[i]
            else:
                seg[i] = seq

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more keys (at most ``max_keys`` in all) at once, rather than
        growing step by step while they are added (a rebuild knows how many will come)."""
        want = min(self._tail - self._head + n, self.max_keys)
        if want <= 0:
            return
        if want > self._cap:
            self._grow_ring(want)
        per_seg = want * 5 // 4 // _NSEG + 1  # some slack: the keys do not spread evenly
        size = _SEG_MIN
        while size <= 2 * per_seg:
            size *= 2
        for si in range(_NSEG):
            if len(self._segs[si]) < size:
                self._grow_seg(si, size)

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
        tid = self._topics.pop(topic, None)
        if tid is not None:
            del self._live[tid]

    def effective_window_s(self, now_ms: int) -> float:
        """Seconds back from ``now_ms`` in which every stored key is still remembered: the
        configured window, or less while keys that young were forgotten for ``max_keys``."""
        w = self.window_ms
        if self._cut_ts is not None and now_ms - self._cut_ts < w:
            w = max(now_ms - self._cut_ts, 0)
        return w / 1000

    def status(self, now_ms: int) -> dict[str, float | int]:
        """The window as the broker status shows it."""
        return {"window_s": self.window_ms / 1000,
                "effective_window_s": self.effective_window_s(now_ms) if self.enabled else 0,
                "keys": len(self), "max_keys": self.max_keys}

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
        self._head = seq + 1
        h = self._hash[s]
        si = h & _SEG_MASK
        seg = self._segs[si]
        m = len(seg) - 1
        i = (h >> _SEG_BITS) & m
        want = seq + 1
        while True:
            v = seg[i]
            if not v:
                return  # a replaced copy: the index points at the newer one
            if v == want:
                break
            i = (i + 1) & m
        self._delete(seg, i, m)
        self._seg_used[si] -= 1
        tid = self._tid[s] & ~_DIGEST_KIND
        if tid in self._live:  # not a dropped topic's
            self._live[tid] -= 1

    def _delete(self, seg: array, i: int, m: int) -> None:
        """Empty slot ``i`` of a linear-probing table, moving later entries back."""
        base = self._base
        cap = self._cap
        hs = self._hash
        j = i
        while True:
            j = (j + 1) & m
            v = seg[j]
            if not v:
                break
            home = (hs[(v - 1 - base) % cap] >> _SEG_BITS) & m
            # the entry at j may move to i unless its home lies cyclically in (i, j]
            if (home <= i < j) or (i < j < home) or (j < home <= i):
                seg[i] = v
                i = j
        seg[i] = 0

    def _grow_seg(self, si: int, size: int = 0) -> None:
        old = self._segs[si]
        m = (size or len(old) * 2) - 1
        new = array("Q", bytes(8 * (m + 1)))
        base = self._base
        cap = self._cap
        hs = self._hash
        for v in old:
            if v:
                i = (hs[(v - 1 - base) % cap] >> _SEG_BITS) & m
                while new[i]:
                    i = (i + 1) & m
                new[i] = v
        self._segs[si] = new

    def _grow_ring(self, cap: int = 0) -> None:
        """Grow the ring (doubling, up to max_keys), laying it out from the head again."""
        n = self._tail - self._head
        cap = max(cap or min(max(self._cap * 2, _RING_MIN), self.max_keys), n + 1)
        start = (self._head - self._base) % self._cap if self._cap else 0
        for name, width in (("_ident", _IDENT), ("_tid", 0), ("_hash", 0), ("_queue", 0),
                            ("_offset", 0), ("_ts", 0)):
            old = getattr(self, name)
            w = width or old.itemsize
            if width:
                new = bytearray(old[start * w:(start + n) * w])
            else:
                new = array(old.typecode, old[start:start + n])
            k = n - len(new) // w if width else n - len(new)
            if k:
                new.extend(old[:k * w] if width else old[:k])
            new.extend(bytes((cap - n) * w) if width else
                       array(old.typecode, bytes((cap - n) * w)))
            setattr(self, name, new)
        self._base = self._head
        self._cap = cap
