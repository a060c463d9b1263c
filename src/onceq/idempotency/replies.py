"""Replies kept with dedup records (request-reply, docs/request_reply.md).

A responder guarded by the idempotency layer answers a request once: the reply is written
into the request's dedup record while the responder still owns its claim (``put_replies``,
compare-and-set on the owner token of a ``CONSUMING`` record, just before the completion),
and kept as long as the record (its retention). A redelivered copy of the request, found a
``DUPLICATE``, is answered with the stored reply (``get_replies``: the replies of
``CONSUMED`` records) instead of running the handler again. A crash between the two writes
leaves a ``CONSUMING`` record: its takeover follows the ambiguous-outcome policy, and a
handler run again writes its own reply over the old one.

The stores keep the reply apart from the record's fields (``Record`` is unchanged): the SQL
stores in a ``reply`` column added to an existing table on first use, the Redis store in a
field ``rp`` of the record's hash (base64), the in-memory store beside its records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["ReplyItem", "ReplyStore", "get_replies", "keeps_replies", "put_replies"]

# one reply to keep: (topic, dedup key, the claim's owner token, the reply's body)
ReplyItem = tuple[str, str, str, bytes]


@runtime_checkable
class ReplyStore(Protocol):
    """A dedup store that keeps replies with its records."""

    async def put_replies(self, group: str, items: Sequence[ReplyItem]) -> list[bool]:
        """Store each reply in its record if the owner token still holds the record's
        ``CONSUMING`` claim; per item, whether it was stored."""
        ...

    async def get_replies(self, group: str, keys: Sequence[tuple[str, str]]
                          ) -> list[bytes | None]:
        """The stored reply of each (topic, key) whose record is ``CONSUMED`` and alive
        (None: no such record, or no reply kept)."""
        ...


def keeps_replies(store: object) -> bool:
    return isinstance(store, ReplyStore)


async def put_replies(store: object, group: str, items: Sequence[ReplyItem]) -> list[bool]:
    """``store.put_replies``; all False for a store that keeps no replies."""
    if not items:
        return []
    if not isinstance(store, ReplyStore):
        return [False] * len(items)
    return await store.put_replies(group, items)


async def get_replies(store: object, group: str, keys: Sequence[tuple[str, str]]
                      ) -> list[bytes | None]:
    """``store.get_replies``; all None for a store that keeps no replies."""
    if not keys:
        return []
    if not isinstance(store, ReplyStore):
        return [None] * len(keys)
    return await store.get_replies(group, keys)
