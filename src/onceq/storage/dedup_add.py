"""Adding keys to the dedup window: one, a batch in store order, or a put's new keys.

An added entry goes to the ring's tail and is linked in at the head of its bucket's chain;
an older entry of the same key (topic and identity) is marked ``DEAD`` so that only the
newest copy answers. Above ``max_keys`` entries the oldest are evicted first, whatever
their age (``DedupWindow._evict``). Batches (the rebuild at start, a put of many messages)
write each ring column with one slice assignment instead of key by key; a put adds the keys
its lookup found absent with the identities that lookup computed (``add_found``).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable, Sequence

from .dedup_keys import DEAD, DIGEST_KIND, H32, IDENT, Found, identities, identity

SMALL_BATCH = 8  # batches up to this size are added key by key


class Adds:
    """The add paths of ``DedupWindow`` (its ring and index are in ``dedup.py``)."""

    __slots__ = ()

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
        self._grow_for(k)
        cap = self._cap
        first = self._tail
        s0 = (first - self._base) % cap
        k1 = min(k, cap - s0)  # up to the ring's end, then from its start
        raw = found.raw if whole else None
        digest_tid = tid | DIGEST_KIND
        for s, lo, hi in ((s0, 0, k1), (0, k1, k)):
            if lo == hi:
                continue
            e = s + hi - lo
            m = hi - lo
            self._ident[s * IDENT:e * IDENT] = raw[lo * IDENT:hi * IDENT] \
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
                    ring_tids[(v - 1 - base) % cap] = DEAD
                    live[tid] -= 1

    def _add_found_one(self, tid: int, found: Found, i: int, queue_id: int, offset: int,
                       ts_ms: int) -> None:
        """``add_found`` for one key, without its per-batch costs."""
        exact = found.exact
        self._put_entry(found.idents[i], tid if exact is None or exact[i] else
                        tid | DIGEST_KIND, found.hashes[i], queue_id, offset, ts_ms)
        live = self._live
        live[tid] += 1
        seqs = found.seqs
        if seqs is not None and seqs[i] > self._head:  # an older copy answers no more
            self._tid[(seqs[i] - 1 - self._base) % self._cap] = DEAD
            live[tid] -= 1

    def _add_one(self, topic: str, key: bytes, queue_id: int, offset: int,
                 ts_ms: int) -> None:
        """``_add_chunk`` for one key, without its per-batch costs."""
        tid = self._topics.get(topic)
        if tid is None:
            tid = self._topic(topic)
        ident, tidk = identity(key, tid, self._digest)
        h = hash(ident) & H32
        v = self._put_entry(ident, tidk, h, queue_id, offset, ts_ms)
        nxt = self._next
        self._live[tid] += 1
        oldest = self._head
        base = self._base
        cap = self._cap
        while v > oldest:
            o = (v - 1 - base) % cap
            if self._hash[o] == h and self._tid[o] == tidk and \
                    self._ident[o * IDENT:o * IDENT + IDENT] == ident:
                self._tid[o] = DEAD
                self._live[tid] -= 1
                return
            v = nxt[o]

    def _add_chunk(self, topics: Sequence[str], keys: Sequence[bytes],
                   queues: Sequence[int], offsets: Sequence[int],
                   ts_ms: Sequence[int]) -> None:
        """``add_columns`` for at most ``max_keys`` keys (so none evicts another)."""
        k = len(keys)
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
        free = self.max_keys - (self._tail - self._head)
        if free < k:
            self._evict(ts_ms[max(free, 0):])
        self._grow_for(k)
        cap = self._cap
        first = self._tail
        s0 = (first - self._base) % cap
        k1 = min(k, cap - s0)  # up to the ring's end, then from its start
        for s, lo, hi in ((s0, 0, k1), (0, k1, k)):
            if lo == hi:
                continue
            e = s + hi - lo
            self._ident[s * IDENT:e * IDENT] = raw[lo * IDENT:hi * IDENT] \
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
        width = IDENT
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
                    ring_tids[o] = DEAD
                    live[tids[j]] -= 1
                    break
                v = nxt[o]
            s += 1
            if s == cap:
                s = 0
