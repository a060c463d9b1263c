"""Answers that wait for durability: under the sync flush policy a write is answered only
once the log bytes it depends on are fsynced (``flush.py``); otherwise at once."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ..protocol.errors import ErrorCode, OnceqError

if TYPE_CHECKING:
    from ..storage.store import MessageStore
    from .connection import Connection
    from .fields import Response
    from .flush import Flusher


def _answer_durable(conn: Connection, corr: int, header: dict[str, Any],
                    fut: asyncio.Future[None]) -> None:
    """Answer a sync-flush write once its fsync is done (or failed)."""
    exc = None if fut.cancelled() else fut.exception()
    if fut.cancelled() or exc is not None:
        err = exc if isinstance(exc, OnceqError) else OnceqError(ErrorCode.FLUSH_TIMEOUT)
        conn.respond(corr, int(err.code), {"message": err.message})
    else:
        conn.respond(corr, 0, header)


class DurableReplies:
    """Answers writes now, or once they are durable. ``flusher`` is set when the broker
    starts (before that nothing is answered)."""

    def __init__(self, store: MessageStore) -> None:
        self.store = store
        self.flusher: Flusher | None = None

    def reply(self, conn: Connection, corr: int, header: dict[str, Any], *,
              end: int | None = None) -> Response:
        """Answer now, or (sync flush) once the bytes before ``end`` (default: everything
        written so far) are fsynced."""
        flusher = self.flusher
        end = self.store.log.end if end is None else end
        if flusher is not None and flusher.sync_policy and end > flusher.flushed:
            fut = flusher.wait_durable(end)
            fut.add_done_callback(lambda f: _answer_durable(conn, corr, header, f))
            return None
        return 0, header, b""
