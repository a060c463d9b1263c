"""Answers that wait for durability: under the sync flush policy a write is answered only
once the log bytes it depends on are fsynced (``flush.py``); otherwise at once."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, TypeVar

from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.schema import Message

if TYPE_CHECKING:
    from ..storage.store import MessageStore
    from .fields import Call
    from .flush import Flusher

M = TypeVar("M", bound=Message)


def _answer_durable(call: Call, reply: Message, fut: asyncio.Future[None]) -> None:
    """Answer a sync-flush write once its fsync is done (or failed)."""
    exc = None if fut.cancelled() else fut.exception()
    if fut.cancelled() or exc is not None:
        call.fail(exc if isinstance(exc, OnceqError) else OnceqError(ErrorCode.FLUSH_TIMEOUT))
    else:
        call.answer(reply)


class DurableReplies:
    """Answers writes now, or once they are durable. ``flusher`` is set when the broker
    starts (before that nothing is answered)."""

    def __init__(self, store: MessageStore) -> None:
        self.store = store
        self.flusher: Flusher | None = None

    def reply(self, call: Call, reply: M, *, end: int | None = None) -> M | None:
        """Answer now, or (sync flush) once the bytes before ``end`` (default: everything
        written so far) are fsynced."""
        flusher = self.flusher
        end = self.store.log.end if end is None else end
        if flusher is not None and flusher.sync_policy and end > flusher.flushed:
            fut = flusher.wait_durable(end)
            fut.add_done_callback(lambda f: _answer_durable(call, reply, f))
            return None
        return reply
