"""Lookups in the dedup window: one topic's keys, one at a time or a put's batch at once.

A lookup hashes the key's identity (``dedup_keys``) to its bucket and walks the bucket's
chain newest first, stopping at the first entry below the ring's head (expired). A put
looks all its keys up at once (``TopicTable.find``): in the usual case no key's bucket
holds an entry and the batch costs one index read per key; the identities computed on the
way are handed on to ``DedupWindow.add_found`` for the keys the put then stores.
"""

from __future__ import annotations

from binascii import unhexlify
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .dedup_keys import DIGEST_KIND, H32, HEX_DIGITS, HEX_KEY, IDENT, Found, identity

if TYPE_CHECKING:
    from .dedup import DedupWindow

_new = object.__new__


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
        ident, tidk = identity(key, tid, w._digest)
        v = self._seek(hash(ident) & H32, tidk, ident)
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
                    w._ident[s * IDENT:s * IDENT + IDENT] == ident:
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
        if len(key) == HEX_KEY and not key.translate(None, HEX_DIGITS):
            f.raw = ident = unhexlify(key)
            f.exact = None
            exact = True
        else:
            f.raw = None
            ident = w._digest(key) if key else b""
            f.exact = [False]
            exact = False
        f.idents = (ident,)
        h = hash(ident) & H32
        f.hashes = (h,)
        tid = self._tid
        if tid is None or not w._heads or not ident:
            return [None], f
        if w._heads[h & w._bmask] <= w._head:  # the usual case: an empty bucket
            return [None], f
        v = self._seek(h, tid if exact else tid | DIGEST_KIND, ident)
        if not v:
            return [None], f
        f.seqs = [v]
        s = (v - 1 - w._base) % w._cap
        return [(w._queue[s], w._offset[s], w._ts[s])], f
