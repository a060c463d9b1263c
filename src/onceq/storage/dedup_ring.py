"""The dedup window's table of keys: a ring of entries and a bucket index over it.

Compact layout (about 65 bytes per key, no Python object per key):

* the entries live in an insertion-ordered ring of parallel ``array`` columns (identity,
  topic id, hash, chain link, queue, offset, store time), numbered by a sequence number
  that only grows; expiry moves the ring's head past the oldest entries;
* the index is a table of buckets (one per possible key, up to 4 M) placed by Python's
  per-process randomised hash of the identity; each bucket holds the sequence number of its
  newest entry, each entry that of the next older one in its bucket. A link to a sequence
  number below the ring's head ends the chain, so expiry never touches the index.

Links are stored as sequence number + 1 (0: none). An entry whose key was added again since
has ``DEAD`` in its topic-id column and is never found. ``KeyRing`` knows nothing of topic
names, time or limits: that is the window's (``dedup.py``).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence

from .dedup_keys import DEAD, DIGEST_KIND, IDENT, Found

_MAX_BUCKETS = 1 << 22  # index buckets: one per key up to this (32 MiB), then shared
RING_MIN = 1024  # entries of the ring when first needed
# bytes per entry of each exported column: identity, topic id, queue, offset, store time
COLUMN_WIDTHS = (IDENT, 4, 2, 8, 8)

Hit = tuple[int, int, int]  # (queue id, offset, store time) of a key found


class KeyRing:
    """The entries (sequence numbers ``[head, tail)``) and their bucket index."""

    __slots__ = ("base", "bmask", "cap", "hash", "head", "heads", "ident", "next", "offset",
                 "queue", "tail", "tid", "ts")

    def __init__(self) -> None:
        # sequence number n is at slot (n - base) % cap
        self.cap = 0
        self.base = self.head = self.tail = 0
        self.ident = bytearray()
        self.tid = array("I")
        self.hash = array("I")
        self.next = array("Q")  # seq + 1 of the next older entry of the bucket (0: none)
        self.queue = array("H")
        self.offset = array("q")
        self.ts = array("q")
        # seq + 1 of each bucket's newest entry (allocated at the first add)
        self.heads = array("Q")
        self.bmask = 0

    def __len__(self) -> int:
        return self.tail - self.head

    def slot(self, seq: int) -> int:
        return (seq - self.base) % self.cap

    def oldest_ts(self) -> int:
        return self.ts[(self.head - self.base) % self.cap]

    def hit(self, v: int) -> Hit:
        """(queue, offset, store time) of the entry of seq + 1 ``v``."""
        s = (v - 1 - self.base) % self.cap
        return self.queue[s], self.offset[s], self.ts[s]

    def kill(self, v: int) -> bool:
        """Mark the entry of seq + 1 ``v`` dead, if still held; True if it was."""
        if v > self.head:
            self.tid[(v - 1 - self.base) % self.cap] = DEAD
            return True
        return False

    # ------------------------------------------------------------------ room
    def alloc_heads(self, max_keys: int) -> None:
        b = 1
        while b < min(max_keys, _MAX_BUCKETS):
            b *= 2
        self.heads = array("Q", bytes(8 * b))
        self.bmask = b - 1

    def grow(self, cap: int) -> None:
        """Grow the ring to ``cap`` entries (at least one more than held), laying it out
        from the head again."""
        n = self.tail - self.head
        cap = max(cap, n + 1)
        start = (self.head - self.base) % self.cap if self.cap else 0
        for name, width in (("ident", IDENT), ("tid", 0), ("hash", 0), ("next", 0),
                            ("queue", 0), ("offset", 0), ("ts", 0)):
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
        self.base = self.head
        self.cap = cap

    def drop(self, end: int, small: bool) -> Counter[int]:
        """Move the head to ``end``; the count of the dropped entries still live, per
        topic id (``small``: few entries, counted one by one)."""
        cap = self.cap
        s = (self.head - self.base) % cap
        e = s + (end - self.head)
        tids = self.tid
        counts: Counter[int] = Counter()
        if small:
            for i in range(s, e):
                t = tids[i if i < cap else i - cap]
                if t != DEAD:
                    counts[t & ~DIGEST_KIND] += 1
        else:
            raw = Counter(tids[s:min(e, cap)])
            if e > cap:
                raw.update(tids[:e - cap])
            for t, c in raw.items():
                if t != DEAD:
                    counts[t & ~DIGEST_KIND] += c
        self.head = end
        return counts

    # ------------------------------------------------------------------ entries
    def put(self, ident: bytes, tidk: int, h: int, queue_id: int, offset: int,
            ts_ms: int) -> int:
        """Append one entry (room made first) and link it at the head of its bucket;
        the bucket's previous head (seq + 1, 0: none), where its chain goes on."""
        s = (self.tail - self.base) % self.cap
        self.ident[s * IDENT:s * IDENT + IDENT] = ident
        self.tid[s] = tidk
        self.hash[s] = h
        self.queue[s] = queue_id
        self.offset[s] = offset
        self.ts[s] = ts_ms
        seq = self.tail = self.tail + 1  # seq + 1 of the new entry
        heads = self.heads
        b = h & self.bmask
        v = heads[b]
        self.next[s] = v
        heads[b] = seq
        return v

    def write(self, raw: bytes | None, idents: Sequence[bytes], tidks: Sequence[int] | None,
              tid: int, hashes: Sequence[int], queues: Sequence[int] | int,
              offsets: Sequence[int], ts_ms: Sequence[int] | int) -> int:
        """Write ``len(hashes)`` entries at the tail (room made first), column by column,
        without linking them; the slot of the first. ``raw``: the identities end to end
        (else ``idents``); ``tidks``: each one's topic-id column value (None: all ``tid``);
        a single queue or store time stands for every entry."""
        k = len(hashes)
        cap = self.cap
        s0 = (self.tail - self.base) % cap
        k1 = min(k, cap - s0)  # up to the ring's end, then from its start
        for s, lo, hi in ((s0, 0, k1), (0, k1, k)):
            if lo == hi:
                continue
            e = s + hi - lo
            m = hi - lo
            self.ident[s * IDENT:e * IDENT] = raw[lo * IDENT:hi * IDENT] \
                if raw is not None else b"".join(idents[lo:hi])
            self.tid[s:e] = array("I", [tid]) * m if tidks is None else \
                array("I", tidks[lo:hi])
            self.hash[s:e] = array("I", hashes[lo:hi])
            self.queue[s:e] = array("H", [queues]) * m if isinstance(queues, int) else \
                array("H", queues[lo:hi])
            self.offset[s:e] = array("q", offsets[lo:hi])
            self.ts[s:e] = array("q", [ts_ms]) * m if isinstance(ts_ms, int) else \
                array("q", ts_ms[lo:hi])
        self.tail += k
        return s0

    def link(self, first: int, s0: int, hashes: Sequence[int]) -> None:
        """Link the entries of seqs ``first``... (from slot ``s0``) in at the head of
        their buckets."""
        heads = self.heads
        bmask = self.bmask
        nxt = self.next
        cap = self.cap
        k = len(hashes)
        bks = [h & bmask for h in hashes]
        if s0 + k <= cap and len(set(bks)) == k:  # no wrap, no two in one bucket: at once
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

    def link_replacing(self, first: int, s0: int, hashes: Sequence[int],
                       tidks: Sequence[int], idents: Sequence[bytes]) -> list[int]:
        """``link``, and mark dead the older entry of each key, if held; the indexes of
        the entries that replaced one."""
        heads = self.heads
        bmask = self.bmask
        nxt = self.next
        hs = self.hash
        ring_tids = self.tid
        ring_idents = self.ident
        width = IDENT
        base = self.base
        cap = self.cap
        oldest = self.head
        replaced = []
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
                    replaced.append(j)
                    break
                v = nxt[o]
            s += 1
            if s == cap:
                s = 0
        return replaced

    # ------------------------------------------------------------------ lookups
    def seek(self, v: int, h: int, tidk: int, ident: bytes) -> int:
        """The seq + 1 of the live entry with this hash, topic kind and identity (0: none):
        a walk down a bucket's chain from ``v``, newest first."""
        first = self.head
        base = self.base
        cap = self.cap
        hs = self.hash
        nxt = self.next
        while v > first:  # v - 1 < first: an empty bucket, or only expired entries
            s = (v - 1 - base) % cap
            if hs[s] == h and self.tid[s] == tidk and \
                    self.ident[s * IDENT:s * IDENT + IDENT] == ident:
                return v
            v = nxt[s]
        return 0

    def bucket(self, h: int) -> int:
        """The seq + 1 of the newest entry of the bucket of hash ``h`` (0: none)."""
        return self.heads[h & self.bmask] if self.heads else 0

    def find(self, tid: int, found: Found) -> list[Hit | None]:
        """The entry of each key of ``found`` in topic ``tid`` (an empty key is never
        found); the seq + 1 of each entry found goes to ``found.seqs``."""
        n = len(found.hashes)
        res: list[Hit | None] = [None] * n
        heads = self.heads
        if not heads:
            return res
        bmask = self.bmask
        first = self.head
        vs = [heads[h & bmask] for h in found.hashes]
        if max(vs, default=0) <= first:  # the usual case: no key's bucket holds an entry
            return res
        base = self.base
        cap = self.cap
        hs = self.hash
        nxt = self.next
        ring_tids = self.tid
        ring_idents = self.ident
        exact = found.exact
        idents = found.idents
        hashes = found.hashes
        seqs = found.seqs = [0] * n
        digest_tid = tid | DIGEST_KIND
        for i, v in enumerate(vs):
            if v <= first or not idents[i]:
                continue
            h = hashes[i]
            ident = idents[i]
            tidk = tid if exact is None or exact[i] else digest_tid
            while v > first:
                s = (v - 1 - base) % cap
                if hs[s] == h and ring_tids[s] == tidk and \
                        ring_idents[s * IDENT:s * IDENT + IDENT] == ident:
                    res[i] = self.queue[s], self.offset[s], self.ts[s]
                    seqs[i] = v
                    break
                v = nxt[s]
        return res

    # ------------------------------------------------------------------ export, restore
    def export(self, first: int) -> list[bytes]:
        """The columns of ``COLUMN_WIDTHS`` of the entries from seq ``first`` to the tail."""
        n = self.tail - first
        cap = self.cap
        s = (first - self.base) % cap if cap else 0
        k1 = min(n, cap - s)
        parts = []
        for col, w in ((self.ident, IDENT), (self.tid, 0), (self.queue, 0),
                       (self.offset, 0), (self.ts, 0)):
            if w:
                parts.append(bytes(col[s * w:(s + k1) * w]) + bytes(col[:(n - k1) * w]))
            else:
                parts.append(col[s:s + k1].tobytes() + col[:n - k1].tobytes())
        return parts

    def load(self, cols: Sequence[memoryview], n: int, cap: int, max_keys: int) -> None:
        """Fill the empty ring with ``n`` exported entries (``export``'s columns) in a ring
        of ``cap``, and index them."""
        self.ident = bytearray(cols[0])
        self.ident.extend(bytes((cap - n) * IDENT))
        for name, code, col in (("tid", "I", cols[1]), ("queue", "H", cols[2]),
                                ("offset", "q", cols[3]), ("ts", "q", cols[4]),
                                ("hash", "I", None), ("next", "Q", None)):
            a = array(code)
            if col is not None:
                a.frombytes(col)
                a.extend(array(code, bytes((cap - n) * a.itemsize)))
            else:
                a.frombytes(bytes(cap * a.itemsize))
            setattr(self, name, a)
        self.cap = cap
        self.base = self.head = 0
        self.tail = n
        self.alloc_heads(max_keys)
        heads = self.heads
        bmask = self.bmask
        hs = self.hash
        nxt = self.next
        h32 = 0xFFFFFFFF
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
