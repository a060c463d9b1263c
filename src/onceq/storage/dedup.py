"""Broker-side dedup window for producer retries, keyed on (topic, unique key).

A retried send whose unique key was stored within the window gets the first send's result
back, flagged as a duplicate, and stores nothing. The window is rebuilt from the commit log
at start (records carry their unique key and store time), or restored from its journal
(``export``, ``restore``; see ``dedup_journal``), so it survives restarts. Memory is
bounded by ``max_keys``: above it the oldest keys are forgotten first, and the window is
then shorter than configured (``effective_window_s``; a warning is logged).

This module holds the window's data structure; each key is kept as a 20-byte identity
(``dedup_keys``), looked up through ``TopicTable`` (``dedup_lookup``) and added through the
paths of ``dedup_add``. Compact layout (about 65 bytes per key, no Python object per key):

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
from array import array
from collections import Counter
from collections.abc import Sequence

from .dedup_add import SMALL_BATCH, Adds
from .dedup_keys import DEAD, DIGEST_KIND, H32, IDENT, Digests
from .dedup_lookup import TopicTable

log = logging.getLogger("onceq.storage")

_MAX_BUCKETS = 1 << 22  # index buckets: one per key up to this (32 MiB), then shared
_RING_MIN = 1024  # entries of the ring when first needed
_MAX_TID = DIGEST_KIND - 1  # topic ids run below this, so no live entry reads as DEAD
_WARN_EVERY_MS = 60_000
# bytes per entry of each column of ``export``: identity, topic id, queue, offset, store time
COLUMN_WIDTHS = (IDENT, 4, 2, 8, 8)


class DedupWindow(Adds):
    __slots__ = ("_base", "_bmask", "_cap", "_cut_ts", "_digest", "_hash", "_head", "_heads",
                 "_ident", "_live", "_next", "_next_tid", "_offset", "_queue", "_tables", "_tail",
                 "_tid", "_topics", "_ts", "_warned_ms", "max_keys", "window_ms")

    def __init__(self, window_s: float, max_keys: int) -> None:
        self.window_ms = int(window_s * 1000)
        self.max_keys = max_keys
        self._digest = Digests()
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

    # ------------------------------------------------------------------ room and expiry
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
        for col, w in ((self._ident, IDENT), (self._tid, 0), (self._queue, 0),
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
        n = len(columns[1]) // 4
        if (self._tail or meta["window_ms"] != self.window_ms or not self.enabled
                or meta["max_keys"] != self.max_keys or not n
                or any(len(c) != n * w for c, w in zip(columns, COLUMN_WIDTHS, strict=True))):
            return False
        drop = max(0, n - self.max_keys)
        n -= drop
        cols = [memoryview(c)[drop * w:] for c, w in zip(columns, COLUMN_WIDTHS, strict=True)]
        self._digest = Digests(bytes.fromhex(meta["secret"]))
        self._cut_ts = meta["cut_ts"]
        for name, (tid, created) in meta["topics"].items():
            if topics.get(name) == created:  # else dropped meanwhile: its keys stay unseen
                self._topics[name] = tid
                self._live[tid] = 0
        self._next_tid = (max(tid for tid, _c in meta["topics"].values()) + 1) % _MAX_TID \
            if meta["topics"] else 0
        cap = max(n, min(self.max_keys, _RING_MIN))
        self._ident = bytearray(cols[0])
        self._ident.extend(bytes((cap - n) * IDENT))
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
            if t != DEAD:
                t &= ~DIGEST_KIND
                if t in live:
                    live[t] += c
        self._alloc_heads()
        heads = self._heads
        bmask = self._bmask
        hs = self._hash
        nxt = self._next
        h32 = H32
        idents = bytes(cols[0])
        step = 1 << 16
        for a in range(0, n, step):  # hashes and chains, in slices (the idents are objects)
            b = min(a + step, n)
            hashes = [hash(idents[i:i + IDENT]) & h32
                      for i in range(a * IDENT, b * IDENT, IDENT)]
            hs[a:b] = array("I", hashes)
            seq = a
            for h in hashes:
                bk = h & bmask
                nxt[seq] = heads[bk]
                seq += 1
                heads[bk] = seq
        return True

    # ------------------------------------------------------------------ internals
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
        self._ident[s * IDENT:s * IDENT + IDENT] = ident
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

    def _grow_for(self, k: int) -> None:
        """Make the ring take ``k`` more entries (``k`` <= max_keys, room made first):
        at least doubling, up to ``max_keys``."""
        n = self._tail - self._head + k
        if n > self._cap:
            self._grow_ring(min(max(self._cap * 2, _RING_MIN, n), self.max_keys))

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
        if end - first <= SMALL_BATCH:
            for i in range(s, e):
                t = tids[i if i < cap else i - cap]
                if t != DEAD:
                    t &= ~DIGEST_KIND
                    if t in live:  # not a dropped topic's
                        live[t] -= 1
            self._head = end
            return
        counts = Counter(tids[s:min(e, cap)])
        if e > cap:
            counts.update(tids[:e - cap])
        for t, c in counts.items():
            if t != DEAD:
                t &= ~DIGEST_KIND
                if t in live:
                    live[t] -= c
        self._head = end

    def _grow_ring(self, cap: int = 0) -> None:
        """Grow the ring (doubling, up to max_keys), laying it out from the head again."""
        n = self._tail - self._head
        cap = max(cap or min(max(self._cap * 2, _RING_MIN), self.max_keys), n + 1)
        start = (self._head - self._base) % self._cap if self._cap else 0
        for name, width in (("_ident", IDENT), ("_tid", 0), ("_hash", 0), ("_next", 0),
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
