"""Answers that wait for durability: under the sync flush policy a write is answered only
once the log bytes it depends on are fsynced (``flush.py``); otherwise at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
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
        # in a broker group: a write ending at this position was made; None when it may
        # be answered now, else a future done once the replicas have it (cluster_node.py)
        self.replicated: Callable[[int], asyncio.Future[None] | None] | None = None

    def reply(self, call: Call, reply: M, *, end: int | None = None) -> M | None:
        """Answer now, or (sync flush) once the bytes before ``end`` (default: everything
        written so far) are fsynced, and (in a broker group) replicated."""
        flusher = self.flusher
        end = self.store.log.end if end is None else end
        waits: list[asyncio.Future[None]] = []
        if flusher is not None and flusher.sync_policy and end > flusher.flushed:
            waits.append(flusher.wait_durable(end))
        if self.replicated is not None:
            replicated = self.replicated(end)
            if replicated is not None:
                waits.append(replicated)
        if not waits:
            return reply
        fut = waits[0] if len(waits) == 1 else _both(waits)
        fut.add_done_callback(lambda f: _answer_durable(call, reply, f))
        return None


def _both(waits: list[asyncio.Future[None]]) -> asyncio.Future[None]:
    """Done when every one of ``waits`` is; failed with the first failure."""
    out: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    left = [len(waits)]

    def done(f: asyncio.Future[None]) -> None:
        left[0] -= 1
        exc = None if f.cancelled() else f.exception()
        if out.done():
            return
        if f.cancelled():
            out.cancel()
        elif exc is not None:
            out.set_exception(exc)
        elif left[0] == 0:
            out.set_result(None)

    for w in waits:
        w.add_done_callback(done)
    return out
