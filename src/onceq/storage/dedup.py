"""Broker-side dedup window for producer retries, keyed on (topic, unique key).

A retried send whose unique key was stored within the window gets the first send's result
back, flagged as a duplicate, and stores nothing. The window is rebuilt from the commit log
at start (records carry their unique key and store time), or restored from its journal
(``export``, ``restore``; see ``dedup_journal``), so it survives restarts. Memory is
bounded by ``max_keys``: above it the oldest keys are forgotten first, and the window is
then shorter than configured (``effective_window_s``; a warning is logged).

Compact layout (about 65 bytes per key, no Python object per key):

* each key is kept as a 20-byte identity: the key itself when it has the producer's shape
  (40 upper-case hex digits, stored as their 20 bytes, exact), else a 128-bit BLAKE2b
  digest of the key, keyed with a secret drawn at random per window (and kept in its
  journal). Two different keys answer "duplicate" for each other only if their digests
  collide: with 128 bits and 2 million keys in the window the odds are about 1 in 10^26,
  and no client can aim at another's key without the secret;
* the entries live in an insertion-ordered ring of parallel ``array`` columns (identity,
  topic id, hash, chain link, queue, offset, store time), numbered by a sequence number
  that only grows; expiry moves the ring's head past the oldest entries;
* the index is a table of buckets (one per possible key, up to 4 M) placed by Python's
  per-process randomised hash of the identity; each bucket holds the sequence number of its
  newest entry, each entry that of the next older one in its bucket. A link to a sequence
  number below the ring's head ends the chain, so expiry never touches the index.

A key added again marks its older entry dead. A topic gets a new id when it is dropped: its
entries stay in the ring (they still count against ``max_keys``) but can no longer be
found, and go with their time.
"""

from __future__ import annotations

import logging
import os
import struct
from array import array
from binascii import unhexlify
from collections import Counter
from collections.abc import Iterable, Sequence
from hashlib import blake2b

log = logging.getLogger("onceq.storage")

_MAX_BUCKETS = 1 << 22  # index buckets: one per key up to this (32 MiB), then shared
_RING_MIN = 1024  # entries of the ring when first needed
_IDENT = 20  # bytes of a key's identity in the ring
_HEX_KEY = 2 * _IDENT  # a producer's unique key: 40 upper-case hex digits
_HEX_DIGITS = b"0123456789ABCDEF"
_DIGEST_KIND = 1 << 31  # in the topic-id column: the identity is a digest, not the key
_DEAD = 0xFFFFFFFF  # in the topic-id column: a key added again since (or never matches)
_MAX_TID = _DIGEST_KIND - 1  # topic ids run below this, so no live entry reads as _DEAD
_H32 = 0xFFFFFFFF
_WARN_EVERY_MS = 60_000
_SMALL = 8  # batches up to this size are added key by key


class _Digests:
    """128-bit keyed BLAKE2b digests of the keys that are not producer-shaped."""

    __slots__ = ("_copy", "secret")

    def __init__(self, secret: bytes | None = None) -> None:
        self.secret = secret or os.urandom(16)
        self._copy = blake2b(digest_size=16, key=self.secret).copy

    def __call__(self, key: bytes) -> bytes:
        h = self._copy()
        h.update(key)
        return h.digest() + b"\0\0\0\0"


def _identity(key: bytes, tid: int, digest: _Digests) -> tuple[bytes, int]:
    """(20-byte identity, topic-id column value) of a key."""
    if len(key) == _HEX_KEY and not key.translate(None, _HEX_DIGITS):
        return unhexlify(key), tid
    return digest(key), tid | _DIGEST_KIND


_new = object.__new__
_SPLITS: dict[int, struct.Struct] = {}  # n -> the layout of n identities end to end


def _split(raw: bytes, n: int) -> list[bytes] | tuple[bytes, ...]:
    """The ``n`` identities laid end to end in ``raw``, as bytes objects."""
    st = _SPLITS.get(n)
    if st is None:
        if len(_SPLITS) >= 256:
            return [raw[i:i + _IDENT] for i in range(0, n * _IDENT, _IDENT)]
        st = _SPLITS[n] = struct.Struct(f"{_IDENT}s" * n)
    return st.unpack(raw)


class Found:
    """The keys of one put, looked up at once (``TopicTable.find``): their identities, kept
    for ``DedupWindow.add_found`` so that no key's identity is computed twice."""

    __slots__ = ("exact", "hashes", "idents", "keys", "raw", "seqs")

    def __init__(self, keys: Sequence[bytes], digest: _Digests) -> None:
        self.keys = keys
        self.seqs: list[int] | None = None  # seq + 1 of each key's entry found (0: none)
        n = len(keys)
        raw = b"".join(keys)
        # the usual batch: every key producer-shaped, made exact in one call
        if (len(raw) == _HEX_KEY * n and n and max(map(len, keys)) == _HEX_KEY
                and not raw.translate(None, _HEX_DIGITS)):
            raw = unhexlify(raw)
            self.raw: bytes | None = raw
            self.exact: list[bool] | None = None  # None: all exact
            self.idents: Sequence[bytes] = _split(raw, n)
        else:
            hex_key = _HEX_KEY
            hexdigits = _HEX_DIGITS
            self.raw = None
            self.exact = exact = [len(key) == hex_key and not key.translate(None, hexdigits)
                                  for key in keys]
            self.idents = [unhexlify(key) if e else digest(key) if key else b""
                           for key, e in zip(keys, exact, strict=True)]
        h32 = _H32
        self.hashes = [hash(ident) & h32 for ident in self.idents]


class TopicTable:
    """Lookups in one topic's part of the window: ``get(key)`` -> (queue, offset, ts_ms)."""

    __slots__ = ("_tid", "_window")

    def __init__(self, window: DedupWindow, tid: int | None) -> None:
        self._window = window
        self._tid = tid

    def get(self, key: bytes) -> tuple[int, int, int] | None:
        tid = self._tid
        w = self._window
        if tid is None or not w._heads:
            return None
        ident, tidk = _identity(key, tid, w._digest)
        v = self._seek(hash(ident) & _H32, tidk, ident)
        if not v:
            return None
        s = (v - 1 - w._base) % w._cap
        return w._queue[s], w._offset[s], w._ts[s]

    def _seek(self, h: int, tidk: int, ident: bytes) -> int:
        """The sequence number of the live entry with this hash, topic kind and identity
        (0: none): a walk down its bucket's chain, newest first."""
        w = self._window
        v = w._heads[h & w._bmask]
        first = w._head
        base = w._base
        cap = w._cap
        hs = w._hash
        nxt = w._next
        while v > first:  # v - 1 < first: an empty bucket, or only expired entries
            s = (v - 1 - base) % cap
            if hs[s] == h and w._tid[s] == tidk and \
                    w._ident[s * _IDENT:s * _IDENT + _IDENT] == ident:
                return v
            v = nxt[s]
        return 0

    def find(self, keys: Sequence[bytes]) -> tuple[list[tuple[int, int, int] | None], Found]:
        """``get`` for each of ``keys`` (an empty key is never found), and the keys'
        identities for ``DedupWindow.add_found``."""
        w = self._window
        if len(keys) == 1:
            return self._find_one(keys)
        f = Found(keys, w._digest)
        n = len(keys)
        res: list[tuple[int, int, int] | None] = [None] * n
        tid = self._tid
        heads = w._heads
        if tid is None or not heads:
            return res, f
        bmask = w._bmask
        first = w._head
        vs = [heads[h & bmask] for h in f.hashes]
        if max(vs, default=0) <= first:  # the usual case: no key's bucket holds an entry
            return res, f
        base = w._base
        cap = w._cap
        hs = w._hash
        nxt = w._next
        ring_tids = w._tid
        ring_idents = w._ident
        exact = f.exact
        idents = f.idents
        hashes = f.hashes
        seqs = f.seqs = [0] * n
        digest_tid = tid | _DIGEST_KIND
        for i, v in enumerate(vs):
            if v <= first or not idents[i]:
                continue
            h = hashes[i]
            ident = idents[i]
            tidk = tid if exact is None or exact[i] else digest_tid
            while v > first:
                s = (v - 1 - base) % cap
                if hs[s] == h and ring_tids[s] == tidk and \
                        ring_idents[s * _IDENT:s * _IDENT + _IDENT] == ident:
                    res[i] = w._queue[s], w._offset[s], w._ts[s]
                    seqs[i] = v
                    break
                v = nxt[s]
        return res, f

    def _find_one(self, keys: Sequence[bytes]) -> tuple[list[tuple[int, int, int] | None],
                                                         Found]:
        """``find`` of one key, without its per-batch costs."""
        w = self._window
        f = _new(Found)
        f.keys = keys
        f.seqs = None
        key = keys[0]
        if len(key) == _HEX_KEY and not key.translate(None, _HEX_DIGITS):
            f.raw = ident = unhexlify(key)
            f.exact = None
            exact = True
        else:
            f.raw = None
            ident = w._digest(key) if key else b""
            f.exact = [False]
            exact = False
        f.idents = (ident,)
        h = hash(ident) & _H32
        f.hashes = (h,)
        tid = self._tid
        if tid is None or not w._heads or not ident:
            return [None], f
        if w._heads[h & w._bmask] <= w._head:  # the usual case: an empty bucket
            return [None], f
        v = self._seek(h, tid if exact else tid | _DIGEST_KIND, ident)
        if not v:
            return [None], f
        f.seqs = [v]
        s = (v - 1 - w._base) % w._cap
        return [(w._queue[s], w._offset[s], w._ts[s])], f

    def __contains__(self, key: bytes) -> bool:
        return self.get(key) is not None


class DedupWindow:
    __slots__ = ("_base", "_bmask", "_cap", "_cut_ts", "_digest", "_hash", "_head", "_heads",
                 "_ident", "_live", "_next", "_next_tid", "_offset", "_queue", "_tables", "_tail",
                 "_tid", "_topics", "_ts", "_warned_ms", "max_keys", "window_ms")

    def __init__(self, window_s: float, max_keys: int) -> None:
        self.window_ms = int(window_s * 1000)
        self.max_keys = max_keys
        self._digest = _Digests()
        self._topics: dict[str, int] = {}  # topic -> topic id (a new one after a drop)
        self._tables: dict[str, TopicTable] = {}  # of the topics in _topics
        self._live: dict[int, int] = {}  # topic id -> keys that answer
        self._next_tid = 0
        # the ring: sequence number n is at slot (n - _base) % _cap; held seqs [_head, _tail)
        self._cap = 0
        self._base = self._head = self._tail = 0
        self._ident = bytearray()
        self._tid = array("I")
        self._hash = array("I")
        self._next = array("Q")  # seq + 1 of the next older entry of the bucket (0: none)
        self._queue = array("H")
        self._offset = array("q")
        self._ts = array("q")
        # the index: seq + 1 of each bucket's newest entry (allocated at the first add)
        self._heads = array("Q")
        self._bmask = 0
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
        t = self._tables.get(topic)
        if t is None:
            tid = self._topics.get(topic)
            t = TopicTable(self, tid)
            if tid is not None:
                self._tables[topic] = t
        return t

    def _topic(self, topic: str) -> int:
        tid = self._topics.get(topic)
        if tid is None:
            tid = self._topics[topic] = self._next_tid
            self._next_tid = (tid + 1) % _MAX_TID
            self._live[tid] = 0
        return tid

    # ------------------------------------------------------------------ changes
    def add(self, topic: str, key: bytes, queue_id: int, offset: int, ts_ms: int) -> None:
        """Remember ``key`` of ``topic`` as stored at (queue_id, offset) at ``ts_ms``.

        A key already there is replaced (its older copy no longer answers). Above
        ``max_keys`` entries the oldest go first, whatever their age."""
        if self.max_keys > 0:
            if not self._heads:
                self._alloc_heads()
            self._add_one(topic, key, queue_id, offset, ts_ms)

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
        if not self._heads:
            self._alloc_heads()
        if n <= _SMALL:
            for i in range(n):
                self._add_one(topics[i], keys[i], queues[i], offsets[i], ts_ms[i])
            return
        step = min(n, max_keys)
        for a in range(0, n, step):  # a chunk never evicts its own keys
            b = a + step
            self._add_chunk(topics[a:b], keys[a:b], queues[a:b], offsets[a:b], ts_ms[a:b])

    def add_found(self, topic: str, found: Found, which: Sequence[int], queue_id: int,
                  offsets: Sequence[int], ts_ms: int) -> None:
        """``add_columns`` for the keys ``which`` (indexes, no key twice, none empty) of a
        ``TopicTable.find`` of ``topic`` that nothing has changed since, all stored in
        ``queue_id`` at ``ts_ms``, at ``offsets``."""
        k = len(which)
        max_keys = self.max_keys
        if max_keys <= 0 or not k:
            return
        if k > max_keys:  # the batch evicts its own keys: the general way
            self.add_columns([topic] * k, [found.keys[i] for i in which], [queue_id] * k,
                             offsets, [ts_ms] * k)
            return
        if not self._heads:
            self._alloc_heads()
        tid = self._topics.get(topic)
        if tid is None:
            tid = self._topic(topic)
        if k == 1:
            self._add_found_one(tid, found, which[0], queue_id, offsets[0], ts_ms)
            return
        whole = k == len(found.idents)  # every key of the find (which is then 0..k-1)
        idents = found.idents if whole else [found.idents[i] for i in which]
        hashes = found.hashes if whole else [found.hashes[i] for i in which]
        exact = found.exact
        if exact is not None and not whole:
            exact = [exact[i] for i in which]
        free = max_keys - (self._tail - self._head)
        if free < k:  # the oldest entries go first
            self._evict([ts_ms] * (k - max(free, 0)))
        if self._tail - self._head + k > self._cap:
            self._grow_ring(min(max(self._cap * 2, _RING_MIN, self._tail - self._head + k),
                                max_keys))
        cap = self._cap
        first = self._tail
        s0 = (first - self._base) % cap
        k1 = min(k, cap - s0)  # up to the ring's end, then from its start
        raw = found.raw if whole else None
        digest_tid = tid | _DIGEST_KIND
        for s, lo, hi in ((s0, 0, k1), (0, k1, k)):
            if lo == hi:
                continue
            e = s + hi - lo
            m = hi - lo
            self._ident[s * _IDENT:e * _IDENT] = raw[lo * _IDENT:hi * _IDENT] \
                if raw is not None else b"".join(idents[lo:hi])
            self._tid[s:e] = array("I", [tid]) * m if exact is None else \
                array("I", [tid if x else digest_tid for x in exact[lo:hi]])
            self._hash[s:e] = array("I", hashes[lo:hi])
            self._queue[s:e] = array("H", [queue_id]) * m
            self._offset[s:e] = array("q", offsets[lo:hi])
            self._ts[s:e] = array("q", [ts_ms]) * m
        self._tail = first + k
        live = self._live
        live[tid] += k
        # link each entry in at the head of its bucket
        heads = self._heads
        bmask = self._bmask
        nxt = self._next
        bks = [h & bmask for h in hashes]
        if k1 == k and len(set(bks)) == k:  # no wrap, no two in one bucket: all at once
            nxt[s0:s0 + k] = array("Q", map(heads.__getitem__, bks))
            for b, seq in zip(bks, range(first + 1, first + k + 1), strict=True):
                heads[b] = seq
        else:
            seq = first
            s = s0
            for b in bks:
                seq += 1  # seq + 1 of the entry
                nxt[s] = heads[b]
                heads[b] = seq
                s += 1
                if s == cap:
                    s = 0
        # an older copy the find saw, if still held, answers no more
        seqs = found.seqs
        if seqs is not None:
            oldest = self._head
            base = self._base
            ring_tids = self._tid
            for i in which:
                v = seqs[i]
                if v > oldest:
                    ring_tids[(v - 1 - base) % cap] = _DEAD
                    live[tid] -= 1

    def _add_found_one(self, tid: int, found: Found, i: int, queue_id: int, offset: int,
                       ts_ms: int) -> None:
        """``add_found`` for one key, without its per-batch costs."""
        exact = found.exact
        self._put_entry(found.idents[i], tid if exact is None or exact[i] else
                        tid | _DIGEST_KIND, found.hashes[i], queue_id, offset, ts_ms)
        live = self._live
        live[tid] += 1
        seqs = found.seqs
        if seqs is not None and seqs[i] > self._head:  # an older copy answers no more
            self._tid[(seqs[i] - 1 - self._base) % self._cap] = _DEAD
            live[tid] -= 1

    def _alloc_heads(self) -> None:
        b = 1
        while b < min(self.max_keys, _MAX_BUCKETS):
            b *= 2
        self._heads = array("Q", bytes(8 * b))
        self._bmask = b - 1

    def _put_entry(self, ident: bytes, tidk: int, h: int, queue_id: int, offset: int,
                   ts_ms: int) -> int:
        """Append one entry (room made first) and link it at the head of its bucket;
        the bucket's previous head (seq + 1, 0: none), where its chain goes on."""
        if self._tail - self._head >= self.max_keys:
            self._evict((ts_ms,))
        if self._tail - self._head >= self._cap:
            self._grow_ring()
        s = (self._tail - self._base) % self._cap
        self._ident[s * _IDENT:s * _IDENT + _IDENT] = ident
        self._tid[s] = tidk
        self._hash[s] = h
        self._queue[s] = queue_id
        self._offset[s] = offset
        self._ts[s] = ts_ms
        seq = self._tail = self._tail + 1  # seq + 1 of the new entry
        heads = self._heads
        b = h & self._bmask
        v = heads[b]
        self._next[s] = v
        heads[b] = seq
        return v

    def _add_one(self, topic: str, key: bytes, queue_id: int, offset: int,
                 ts_ms: int) -> None:
        """``_add_chunk`` for one key, without its per-batch costs."""
        tid = self._topics.get(topic)
        if tid is None:
            tid = self._topic(topic)
        ident, tidk = _identity(key, tid, self._digest)
        h = hash(ident) & _H32
        v = self._put_entry(ident, tidk, h, queue_id, offset, ts_ms)
        nxt = self._next
        self._live[tid] += 1
        oldest = self._head
        base = self._base
        cap = self._cap
        while v > oldest:
            o = (v - 1 - base) % cap
            if self._hash[o] == h and self._tid[o] == tidk and \
                    self._ident[o * _IDENT:o * _IDENT + _IDENT] == ident:
                self._tid[o] = _DEAD
                self._live[tid] -= 1
                return
            v = nxt[o]

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
        raw: bytes | None = b"".join(keys)
        # the usual chunk: every key producer-shaped, made exact in one call
        if (len(raw) == hex_key * k and max(map(len, keys)) == hex_key
                and not raw.translate(None, hexdigits)):
            raw = unhexlify(raw)
            idents = _split(raw, k)
            tidks = tids
        else:
            raw = None
            exact = [len(key) == hex_key and not key.translate(None, hexdigits)
                     for key in keys]
            digest = self._digest
            idents = [unhexlify(key) if e else digest(key)
                      for key, e in zip(keys, exact, strict=True)]
            tidks = [t if e else t | _DIGEST_KIND for t, e in zip(tids, exact, strict=True)]
        h32 = _H32
        hashes = [hash(ident) & h32 for ident in idents]
        # room: the oldest entries go first (the i-th add evicts when the window is full)
        free = self.max_keys - (self._tail - self._head)
        if free < k:
            self._evict(ts_ms[max(free, 0):])
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
            self._ident[s * _IDENT:e * _IDENT] = raw[lo * _IDENT:hi * _IDENT] \
                if raw is not None else b"".join(idents[lo:hi])
            self._tid[s:e] = array("I", tidks[lo:hi])
            self._hash[s:e] = array("I", hashes[lo:hi])
            self._queue[s:e] = array("H", queues[lo:hi])
            self._offset[s:e] = array("q", offsets[lo:hi])
            self._ts[s:e] = array("q", ts_ms[lo:hi])
        self._tail = first + k
        live = self._live
        for t, c in Counter(tids).items():
            live[t] += c
        # link each entry in at the head of its bucket; an older copy of its key dies
        heads = self._heads
        bmask = self._bmask
        nxt = self._next
        hs = self._hash
        ring_tids = self._tid
        ring_idents = self._ident
        width = _IDENT
        base = self._base
        oldest = self._head
        seq = first
        s = s0
        for j, h in enumerate(hashes):
            seq += 1  # seq + 1 of entry j
            b = h & bmask
            v = heads[b]
            nxt[s] = v
            heads[b] = seq
            while v > oldest:
                o = (v - 1 - base) % cap
                if hs[o] == h and ring_tids[o] == tidks[j] and \
                        ring_idents[o * width:o * width + width] == idents[j]:
                    ring_tids[o] = _DEAD
                    live[tids[j]] -= 1
                    break
                v = nxt[o]
            s += 1
            if s == cap:
                s = 0

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more keys (at most ``max_keys`` in all) at once, rather than
        growing step by step while they are added (a rebuild knows how many will come)."""
        want = min(self._tail - self._head + n, self.max_keys)
        if want > self._cap:
            self._grow_ring(want)

    def expire(self, now_ms: int) -> None:
        """Forget the keys stored before the window (and any above ``max_keys``)."""
        first = self._head
        tail = self._tail
        if first == tail or (self._ts[(first - self._base) % self._cap] >= now_ms -
                             self.window_ms and tail - first <= self.max_keys):
            return  # the usual case on a send: nothing to forget
        if tail - first > self.max_keys:
            self._evict([now_ms] * (tail - first - self.max_keys))
            first = self._head
        limit = now_ms - self.window_ms
        ts = self._ts
        cap = self._cap
        s = (first - self._base) % cap
        h = first
        while h < tail and ts[s] < limit:
            h += 1
            s += 1
            if s == cap:
                s = 0
        if h > first:
            self._drop(first, h)

    def drop_topic(self, topic: str) -> None:
        self._tables.pop(topic, None)
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

    # ------------------------------------------------------------------ journal
    @property
    def next_seq(self) -> int:
        """Sequence number of the next entry added (``export`` takes the ones from a seq)."""
        return self._tail

    def export(self, since: int, topics: dict[str, int]) -> tuple[dict, list[bytes]]:
        """The entries from sequence number ``since`` (from the oldest held, if older) to
        now: a meta dict and five columns (identities, topic ids, queues, offsets, store
        times) that ``restore`` takes back, concatenated with the ones exported before.

        ``topics``: name -> creation position of the live topics (a topic deleted and
        created again in between must not find its old keys)."""
        first = max(since, self._head)
        n = self._tail - first
        cap = self._cap
        s = (first - self._base) % cap if cap else 0
        k1 = min(n, cap - s)
        parts = []
        for col, w in ((self._ident, _IDENT), (self._tid, 0), (self._queue, 0),
                       (self._offset, 0), (self._ts, 0)):
            if w:
                parts.append(bytes(col[s * w:(s + k1) * w]) + bytes(col[:(n - k1) * w]))
            else:
                parts.append(col[s:s + k1].tobytes() + col[:n - k1].tobytes())
        meta = {
            "window_ms": self.window_ms, "max_keys": self.max_keys,
            "secret": self._digest.secret.hex(), "cut_ts": self._cut_ts, "entries": n,
            "topics": {name: [tid, topics[name]] for name, tid in self._topics.items()
                       if name in topics},
        }
        return meta, parts

    def restore(self, meta: dict, columns: Sequence[bytes | memoryview],
                topics: dict[str, int]) -> bool:
        """Fill an empty window from ``export``ed columns (several exports' columns joined,
        oldest first), with the ``meta`` of the last export; False (and no change) when
        they do not fit: other window settings or columns of unequal lengths. Above
        ``max_keys`` entries the newest are kept."""
        widths = (_IDENT, 4, 2, 8, 8)
        n = len(columns[1]) // 4
        if (self._tail or meta["window_ms"] != self.window_ms or not self.enabled
                or meta["max_keys"] != self.max_keys or not n
                or any(len(c) != n * w for c, w in zip(columns, widths, strict=True))):
            return False
        drop = max(0, n - self.max_keys)
        n -= drop
        cols = [memoryview(c)[drop * w:] for c, w in zip(columns, widths, strict=True)]
        self._digest = _Digests(bytes.fromhex(meta["secret"]))
        self._cut_ts = meta["cut_ts"]
        for name, (tid, created) in meta["topics"].items():
            if topics.get(name) == created:  # else dropped meanwhile: its keys stay unseen
                self._topics[name] = tid
                self._live[tid] = 0
        self._next_tid = (max(tid for tid, _c in meta["topics"].values()) + 1) % _MAX_TID \
            if meta["topics"] else 0
        cap = max(n, min(self.max_keys, _RING_MIN))
        self._ident = bytearray(cols[0])
        self._ident.extend(bytes((cap - n) * _IDENT))
        for name, code, col in (("_tid", "I", cols[1]), ("_queue", "H", cols[2]),
                                ("_offset", "q", cols[3]), ("_ts", "q", cols[4]),
                                ("_hash", "I", None), ("_next", "Q", None)):
            a = array(code)
            if col is not None:
                a.frombytes(col)
                a.extend(array(code, bytes((cap - n) * a.itemsize)))
            else:
                a.frombytes(bytes(cap * a.itemsize))
            setattr(self, name, a)
        self._cap = cap
        self._base = self._head = 0
        self._tail = n
        live = self._live
        for t, c in Counter(self._tid[:n]).items():
            if t != _DEAD:
                t &= ~_DIGEST_KIND
                if t in live:
                    live[t] += c
        self._alloc_heads()
        heads = self._heads
        bmask = self._bmask
        hs = self._hash
        nxt = self._next
        h32 = _H32
        idents = bytes(cols[0])
        step = 1 << 16
        for a in range(0, n, step):  # hashes and chains, in slices (the idents are objects)
            b = min(a + step, n)
            hashes = [hash(idents[i:i + _IDENT]) & h32
                      for i in range(a * _IDENT, b * _IDENT, _IDENT)]
            hs[a:b] = array("I", hashes)
            seq = a
            for h in hashes:
                bk = h & bmask
                nxt[seq] = heads[bk]
                seq += 1
                heads[bk] = seq
        return True

    # ------------------------------------------------------------------ internals
    def _evict(self, nows: Sequence[int]) -> None:
        """Drop the ``len(nows)`` oldest entries for the key cap, the i-th at ``nows[i]``;
        note those still inside the window then (the window is cut short)."""
        first = self._head
        ts = self._ts
        cap = self._cap
        window = self.window_ms
        s = (first - self._base) % cap
        cut = None
        for now_ms in nows:
            t = ts[s]
            if t >= now_ms - window:
                cut = (t, now_ms) if cut is None or t > cut[0] else cut
            s += 1
            if s == cap:
                s = 0
        self._drop(first, first + len(nows))
        if cut is not None:
            t, now_ms = cut
            if self._cut_ts is None or t > self._cut_ts:
                self._cut_ts = t
            if now_ms - self._warned_ms >= _WARN_EVERY_MS:
                self._warned_ms = now_ms
                log.warning("store: the dedup window holds its maximum of %d keys: keys "
                            "stored %.1f s ago are forgotten (window %g s); raise "
                            "--dedup-max-keys to keep the whole window",
                            self.max_keys, (now_ms - t) / 1000, window / 1000)

    def _drop(self, first: int, end: int) -> None:
        """Move the head from ``first`` to ``end``: those entries' keys no longer answer."""
        cap = self._cap
        s = (first - self._base) % cap
        e = s + (end - first)
        tids = self._tid
        live = self._live
        if end - first <= _SMALL:
            for i in range(s, e):
                t = tids[i if i < cap else i - cap]
                if t != _DEAD:
                    t &= ~_DIGEST_KIND
                    if t in live:  # not a dropped topic's
                        live[t] -= 1
            self._head = end
            return
        counts = Counter(tids[s:min(e, cap)])
        if e > cap:
            counts.update(tids[:e - cap])
        for t, c in counts.items():
            if t != _DEAD:
                t &= ~_DIGEST_KIND
                if t in live:
                    live[t] -= c
        self._head = end

    def _grow_ring(self, cap: int = 0) -> None:
        """Grow the ring (doubling, up to max_keys), laying it out from the head again."""
        n = self._tail - self._head
        cap = max(cap or min(max(self._cap * 2, _RING_MIN), self.max_keys), n + 1)
        start = (self._head - self._base) % self._cap if self._cap else 0
        for name, width in (("_ident", _IDENT), ("_tid", 0), ("_hash", 0), ("_next", 0),
                            ("_queue", 0), ("_offset", 0), ("_ts", 0)):
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
