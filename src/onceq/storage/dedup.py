"""Broker-side dedup window for producer retries, keyed on (topic, unique key).

A retried send whose unique key was stored within the window gets the first send's result
back, flagged as a duplicate, and stores nothing. The window is rebuilt from the commit log
at start (records carry their unique key and store time), or restored from its journal
(``export``, ``restore``; see ``dedup_journal``), so it survives restarts. Memory is
bounded by ``max_keys``: above it the oldest keys are forgotten first, and the window is
then shorter than configured (``effective_window_s``; a warning is logged).

``DedupWindow`` is the one object callers see. It keeps each key as a 20-byte identity
(``dedup_keys``) in its table of keys (``KeyRing``, ``dedup_ring``: the ring of entries and
the bucket index), and holds what the table does not know: topic names and their ids, the
keys that still answer per topic, the window's time and its key limit.

A key added again marks its older entry dead. A topic gets a new id when it is dropped: its
entries stay in the ring (they still count against ``max_keys``) but can no longer be
found, and go with their time.

Adds: one key, a batch in store order (the rebuild at start: each ring column written with
one slice assignment), or the keys a put's lookup found absent, with the identities that
lookup computed (``find`` then ``add_found``).
"""

from __future__ import annotations

import logging
from binascii import unhexlify
from collections import Counter
from collections.abc import Iterable, Sequence

from .dedup_keys import (
    DEAD,
    DIGEST_KIND,
    H32,
    HEX_DIGITS,
    HEX_KEY,
    Digests,
    Found,
    identities,
    identity,
)
from .dedup_ring import COLUMN_WIDTHS, RING_MIN, Hit, KeyRing

__all__ = ["COLUMN_WIDTHS", "DedupWindow"]

log = logging.getLogger("onceq.storage")

_MAX_TID = DIGEST_KIND - 1  # topic ids run below this, so no live entry reads as DEAD
_WARN_EVERY_MS = 60_000
SMALL_BATCH = 8  # batches up to this size are added key by key
_new = object.__new__


class DedupWindow:
    __slots__ = ("_cut_ts", "_digest", "_live", "_next_tid", "_ring", "_topics",
                 "_warned_ms", "max_keys", "window_ms")

    def __init__(self, window_s: float, max_keys: int) -> None:
        self.window_ms = int(window_s * 1000)
        self.max_keys = max_keys
        self.reset()

    def reset(self) -> None:
        """Forget every key (a new digest secret is drawn)."""
        self._digest = Digests()
        self._topics: dict[str, int] = {}  # topic -> topic id (a new one after a drop)
        self._live: dict[int, int] = {}  # topic id -> keys that answer
        self._next_tid = 0
        self._ring = KeyRing()
        self._cut_ts: int | None = None  # store time of the newest key the cap cut early
        self._warned_ms = -_WARN_EVERY_MS

    @property
    def enabled(self) -> bool:
        return self.window_ms > 0 and self.max_keys > 0

    def __len__(self) -> int:
        return sum(self._live.values())

    def entries(self) -> int:
        """Entries held, dropped topics' and replaced copies' included (at most max_keys)."""
        return len(self._ring)

    # ------------------------------------------------------------------ lookups
    def get(self, topic: str, key: bytes) -> Hit | None:
        """(queue_id, offset, ts_ms) where ``key`` of ``topic`` was stored, or None."""
        tid = self._topics.get(topic)
        r = self._ring
        if tid is None or not r.heads:
            return None
        ident, tidk = identity(key, tid, self._digest)
        h = hash(ident) & H32
        v = r.seek(r.bucket(h), h, tidk, ident)
        return r.hit(v) if v else None

    def find(self, topic: str, keys: Sequence[bytes]) -> tuple[list[Hit | None], Found]:
        """``get`` for each of ``keys`` (an empty key is never found), and the keys'
        identities for ``add_found``."""
        if len(keys) == 1:
            return self._find_one(topic, keys)
        f = Found(keys, self._digest)
        tid = self._topics.get(topic)
        if tid is None:
            return [None] * len(keys), f
        return self._ring.find(tid, f), f

    def _find_one(self, topic: str, keys: Sequence[bytes]) -> tuple[list[Hit | None], Found]:
        """``find`` of one key, without its per-batch costs."""
        f = _new(Found)
        f.keys = keys
        f.seqs = None
        key = keys[0]
        if len(key) == HEX_KEY and not key.translate(None, HEX_DIGITS):
            f.raw = ident = unhexlify(key)
            f.exact = None
            exact = True
        else:
            f.raw = None
            ident = self._digest(key) if key else b""
            f.exact = [False]
            exact = False
        f.idents = (ident,)
        h = hash(ident) & H32
        f.hashes = (h,)
        tid = self._topics.get(topic)
        r = self._ring
        if tid is None or not ident:
            return [None], f
        v = r.bucket(h)
        if v <= r.head:  # the usual case: an empty bucket
            return [None], f
        v = r.seek(v, h, tid if exact else tid | DIGEST_KIND, ident)
        if not v:
            return [None], f
        f.seqs = [v]
        return [r.hit(v)], f

    def _topic(self, topic: str) -> int:
        tid = self._topics.get(topic)
        if tid is None:
            tid = self._topics[topic] = self._next_tid
            self._next_tid = (tid + 1) % _MAX_TID
            self._live[tid] = 0
        return tid

    # ------------------------------------------------------------------ adds
    def add(self, topic: str, key: bytes, queue_id: int, offset: int, ts_ms: int) -> None:
        """Remember ``key`` of ``topic`` as stored at (queue_id, offset) at ``ts_ms``.

        A key already there is replaced (its older copy no longer answers). Above
        ``max_keys`` entries the oldest go first, whatever their age."""
        if self.max_keys > 0:
            if not self._ring.heads:
                self._ring.alloc_heads(self.max_keys)
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
        if not self._ring.heads:
            self._ring.alloc_heads(max_keys)
        if n <= SMALL_BATCH:
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
        ``find`` of ``topic`` that nothing has changed since, all stored in ``queue_id`` at
        ``ts_ms``, at ``offsets``."""
        k = len(which)
        max_keys = self.max_keys
        if max_keys <= 0 or not k:
            return
        if k > max_keys:  # the batch evicts its own keys: the general way
            self.add_columns([topic] * k, [found.keys[i] for i in which], [queue_id] * k,
                             offsets, [ts_ms] * k)
            return
        r = self._ring
        if not r.heads:
            r.alloc_heads(max_keys)
        tid = self._topics.get(topic)
        if tid is None:
            tid = self._topic(topic)
        live = self._live
        if k == 1:  # without the per-batch costs
            i = which[0]
            exact = found.exact
            self._room(1, (ts_ms,))
            r.put(found.idents[i], tid if exact is None or exact[i] else tid | DIGEST_KIND,
                  found.hashes[i], queue_id, offsets[0], ts_ms)
            live[tid] += 1
            if found.seqs is not None and r.kill(found.seqs[i]):  # an older copy answers no more
                live[tid] -= 1
            return
        whole = k == len(found.idents)  # every key of the find (which is then 0..k-1)
        idents = found.idents if whole else [found.idents[i] for i in which]
        hashes = found.hashes if whole else [found.hashes[i] for i in which]
        exact = found.exact
        if exact is not None and not whole:
            exact = [exact[i] for i in which]
        self._room(k, [ts_ms] * k)
        first = r.tail
        digest_tid = tid | DIGEST_KIND
        tidks = None if exact is None else [tid if x else digest_tid for x in exact]
        s0 = r.write(found.raw if whole else None, idents, tidks, tid, hashes, queue_id,
                     offsets, ts_ms)
        live[tid] += k
        r.link(first, s0, hashes)
        # an older copy the find saw, if still held, answers no more
        seqs = found.seqs
        if seqs is not None:
            for i in which:
                if r.kill(seqs[i]):
                    live[tid] -= 1

    def _room(self, k: int, nows: Sequence[int]) -> None:
        """Make the ring take ``k`` more entries (``k`` <= max_keys): the oldest are
        evicted first (the i-th at ``nows[i]``), then it grows (at least doubling, up to
        ``max_keys``)."""
        r = self._ring
        free = self.max_keys - len(r)
        if free < k:
            self._evict(nows[max(free, 0):])
        n = len(r) + k
        if n > r.cap:
            r.grow(min(max(r.cap * 2, RING_MIN, n), self.max_keys))

    def _add_one(self, topic: str, key: bytes, queue_id: int, offset: int,
                 ts_ms: int) -> None:
        """``_add_chunk`` for one key, without its per-batch costs."""
        tid = self._topics.get(topic)
        if tid is None:
            tid = self._topic(topic)
        ident, tidk = identity(key, tid, self._digest)
        h = hash(ident) & H32
        r = self._ring
        if len(r) >= self.max_keys:
            self._evict((ts_ms,))
        if len(r) >= r.cap:
            r.grow(min(max(r.cap * 2, RING_MIN), self.max_keys))
        v = r.put(ident, tidk, h, queue_id, offset, ts_ms)
        self._live[tid] += 1
        old = r.seek(v, h, tidk, ident)
        if old:
            r.kill(old)
            self._live[tid] -= 1

    def _add_chunk(self, topics: Sequence[str], keys: Sequence[bytes],
                   queues: Sequence[int], offsets: Sequence[int],
                   ts_ms: Sequence[int]) -> None:
        """``add_columns`` for at most ``max_keys`` keys (so none evicts another)."""
        known = self._topics
        for t in set(topics):
            if t not in known:
                self._topic(t)
        tids = list(map(known.__getitem__, topics))
        raw, exact, idents = identities(keys, self._digest)
        tidks = tids if exact is None else \
            [t if e else t | DIGEST_KIND for t, e in zip(tids, exact, strict=True)]
        h32 = H32
        hashes = [hash(ident) & h32 for ident in idents]
        # room: the oldest entries go first (the i-th add evicts when the window is full)
        self._room(len(keys), ts_ms)
        r = self._ring
        first = r.tail
        s0 = r.write(raw, idents, tidks, 0, hashes, queues, offsets, ts_ms)
        live = self._live
        for t, c in Counter(tids).items():
            live[t] += c
        # link each entry in at the head of its bucket; an older copy of its key dies
        for j in r.link_replacing(first, s0, hashes, tidks, idents):
            live[tids[j]] -= 1

    # ------------------------------------------------------------------ room and expiry
    def reserve(self, n: int) -> None:
        """Make room for ``n`` more keys (at most ``max_keys`` in all) at once, rather than
        growing step by step while they are added (a rebuild knows how many will come)."""
        r = self._ring
        want = min(len(r) + n, self.max_keys)
        if want > r.cap:
            r.grow(want)

    def expire(self, now_ms: int) -> None:
        """Forget the keys stored before the window (and any above ``max_keys``)."""
        r = self._ring
        n = len(r)
        if not n or (r.oldest_ts() >= now_ms - self.window_ms and n <= self.max_keys):
            return  # the usual case on a send: nothing to forget
        if n > self.max_keys:
            self._evict([now_ms] * (n - self.max_keys))
        first = r.head
        tail = r.tail
        limit = now_ms - self.window_ms
        ts = r.ts
        cap = r.cap
        s = r.slot(first)
        h = first
        while h < tail and ts[s] < limit:
            h += 1
            s += 1
            if s == cap:
                s = 0
        if h > first:
            self._drop(h)

    def drop_topic(self, topic: str) -> None:
        tid = self._topics.pop(topic, None)
        if tid is not None:
            del self._live[tid]

    def _evict(self, nows: Sequence[int]) -> None:
        """Drop the ``len(nows)`` oldest entries for the key cap, the i-th at ``nows[i]``;
        note those still inside the window then (the window is cut short)."""
        r = self._ring
        ts = r.ts
        cap = r.cap
        window = self.window_ms
        s = r.slot(r.head)
        cut = None
        for now_ms in nows:
            t = ts[s]
            if t >= now_ms - window:
                cut = (t, now_ms) if cut is None or t > cut[0] else cut
            s += 1
            if s == cap:
                s = 0
        self._drop(r.head + len(nows))
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

    def _drop(self, end: int) -> None:
        """Move the ring's head to ``end``: those entries' keys no longer answer."""
        r = self._ring
        live = self._live
        for t, c in r.drop(end, end - r.head <= SMALL_BATCH).items():
            if t in live:  # not a dropped topic's
                live[t] -= c

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
        return self._ring.tail

    def export(self, since: int, topics: dict[str, int]) -> tuple[dict, list[bytes]]:
        """The entries from sequence number ``since`` (from the oldest held, if older) to
        now: a meta dict and five columns (identities, topic ids, queues, offsets, store
        times) that ``restore`` takes back, concatenated with the ones exported before.

        ``topics``: name -> creation position of the live topics (a topic deleted and
        created again in between must not find its old keys)."""
        r = self._ring
        first = max(since, r.head)
        parts = r.export(first)
        meta = {
            "window_ms": self.window_ms, "max_keys": self.max_keys,
            "secret": self._digest.secret.hex(), "cut_ts": self._cut_ts,
            "entries": r.tail - first,
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
        if (self._ring.tail or meta["window_ms"] != self.window_ms or not self.enabled
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
        r = self._ring
        r.load(cols, n, max(n, min(self.max_keys, RING_MIN)), self.max_keys)
        live = self._live
        for t, c in Counter(r.tid[:n]).items():
            if t != DEAD:
                t &= ~DIGEST_KIND
                if t in live:
                    live[t] += c
        return True
