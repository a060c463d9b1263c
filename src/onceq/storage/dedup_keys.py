"""The identities the dedup window keeps for unique keys (pure: no I/O).

Each key is kept as a 20-byte identity: the key itself when it has the producer's shape
(40 upper-case hex digits, stored as their 20 bytes, exact), else a 128-bit BLAKE2b digest
of the key, keyed with a secret drawn at random per window (and kept in its journal). Two
different keys answer "duplicate" for each other only if their digests collide: with 128
bits and 2 million keys in the window the odds are about 1 in 10^26, and no client can aim
at another's key without the secret.

The window's topic-id column says which kind an identity is (``DIGEST_KIND``), and marks an
entry whose key was added again since (``DEAD``). ``Found`` carries the identities of one
put's keys from its lookup (``DedupWindow.find``) to its add (``DedupWindow.add_found``).
"""

from __future__ import annotations

import os
import struct
from binascii import unhexlify
from collections.abc import Sequence
from hashlib import blake2b

IDENT = 20  # bytes of a key's identity in the ring
HEX_KEY = 2 * IDENT  # a producer's unique key: 40 upper-case hex digits
HEX_DIGITS = b"0123456789ABCDEF"
DIGEST_KIND = 1 << 31  # in the topic-id column: the identity is a digest, not the key
DEAD = 0xFFFFFFFF  # in the topic-id column: a key added again since (or never matches)
H32 = 0xFFFFFFFF  # identities are placed by the low 32 bits of their hash


class Digests:
    """128-bit keyed BLAKE2b digests of the keys that are not producer-shaped."""

    __slots__ = ("_copy", "secret")

    def __init__(self, secret: bytes | None = None) -> None:
        self.secret = secret or os.urandom(16)
        self._copy = blake2b(digest_size=16, key=self.secret).copy

    def __call__(self, key: bytes) -> bytes:
        h = self._copy()
        h.update(key)
        return h.digest() + b"\0\0\0\0"


def identity(key: bytes, tid: int, digest: Digests) -> tuple[bytes, int]:
    """(20-byte identity, topic-id column value) of a key."""
    if len(key) == HEX_KEY and not key.translate(None, HEX_DIGITS):
        return unhexlify(key), tid
    return digest(key), tid | DIGEST_KIND


def identities(keys: Sequence[bytes], digest: Digests, *, lookup: bool = False
               ) -> tuple[bytes | None, list[bool] | None, Sequence[bytes]]:
    """The identities of ``keys``: (their bytes end to end when every key is exact, else
    None; whether each key is exact, None when all are; the identities).

    ``lookup``: an empty key gets an empty identity (it is never found) instead of the
    digest an added one gets."""
    n = len(keys)
    raw = b"".join(keys)
    # the usual batch: every key producer-shaped, made exact in one call
    if (len(raw) == HEX_KEY * n and n and max(map(len, keys)) == HEX_KEY
            and not raw.translate(None, HEX_DIGITS)):
        raw = unhexlify(raw)
        return raw, None, split(raw, n)
    hex_key = HEX_KEY
    hexdigits = HEX_DIGITS
    exact = [len(key) == hex_key and not key.translate(None, hexdigits) for key in keys]
    if lookup:
        idents = [unhexlify(key) if e else digest(key) if key else b""
                  for key, e in zip(keys, exact, strict=True)]
    else:
        idents = [unhexlify(key) if e else digest(key)
                  for key, e in zip(keys, exact, strict=True)]
    return None, exact, idents


_SPLITS: dict[int, struct.Struct] = {}  # n -> the layout of n identities end to end


def split(raw: bytes, n: int) -> list[bytes] | tuple[bytes, ...]:
    """The ``n`` identities laid end to end in ``raw``, as bytes objects."""
    st = _SPLITS.get(n)
    if st is None:
        if len(_SPLITS) >= 256:
            return [raw[i:i + IDENT] for i in range(0, n * IDENT, IDENT)]
        st = _SPLITS[n] = struct.Struct(f"{IDENT}s" * n)
    return st.unpack(raw)


class Found:
    """The keys of one put, looked up at once (``DedupWindow.find``): their identities, kept
    for ``DedupWindow.add_found`` so that no key's identity is computed twice."""

    __slots__ = ("exact", "hashes", "idents", "keys", "raw", "seqs")

    def __init__(self, keys: Sequence[bytes], digest: Digests) -> None:
        self.keys = keys
        self.seqs: list[int] | None = None  # seq + 1 of each key's entry found (0: none)
        self.raw: bytes | None
        self.exact: list[bool] | None  # None: all exact
        self.idents: Sequence[bytes]
        self.raw, self.exact, self.idents = identities(keys, digest, lookup=True)
        h32 = H32
        self.hashes = [hash(ident) & h32 for ident in self.idents]
