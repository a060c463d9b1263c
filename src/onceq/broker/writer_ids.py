"""Which connection, and which user, an idempotent writer id belongs to.

A sequenced send (``SEND_SEQUENCED``) names its writer, and the broker answers a batch it
has seen as "duplicate, not stored again": whoever could send under another writer's id, with
a far newer epoch, would make that writer's later batches vanish behind a success. So a
writer id is bound to the connection that first sends under it, until that connection
closes, and with ACLs on to the user of that connection for as long as the broker keeps a
sequence of that writer (or a connection sends under it). A
send naming the id from another connection, or another user, is refused with
``WRITER_IN_USE`` (retriable: a Spark task retried on a new connection is served once the
broker has seen the old one close). A connection may own at most ``MAX_PER_CONNECTION``
writer ids.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from ..protocol.errors import ErrorCode, OnceqError

if TYPE_CHECKING:
    from .connection import Connection

MAX_PER_CONNECTION = 10_000


class WriterIds:
    def __init__(self) -> None:
        self._conn: dict[str, Connection] = {}
        self._user: dict[str, str] = {}  # writer id -> the user that first sent under it

    def claim(self, conn: Connection, writer: str) -> None:
        """``conn`` sends under ``writer``: bind it, or refuse with ``WRITER_IN_USE``."""
        owner = self._conn.get(writer)
        if owner is conn:
            return
        if owner is not None and not owner.closed:
            raise OnceqError(ErrorCode.WRITER_IN_USE, f"writer id {writer!r} belongs to "
                             f"another connection ({owner.peer})")
        user = conn.user
        if user is not None and self._user.setdefault(writer, user) != user:
            raise OnceqError(ErrorCode.WRITER_IN_USE, f"writer id {writer!r} belongs to "
                             "another user")
        if len(conn.writer_ids) >= MAX_PER_CONNECTION:
            raise OnceqError(ErrorCode.INVALID_SEQUENCE, f"a connection may send under at "
                             f"most {MAX_PER_CONNECTION} writer ids")
        self._conn[writer] = conn
        conn.writer_ids.add(writer)

    def drop(self, conn: Connection) -> None:
        """``conn`` closed: the writer ids it owned are free (their users stay bound)."""
        for writer in conn.writer_ids:
            if self._conn.get(writer) is conn:
                del self._conn[writer]
        conn.writer_ids.clear()

    def forget_users(self, writers: Collection[tuple[str, ...]], expired: int) -> int:
        """Drop the user binding of every writer id that no open connection sends under
        and no sequence key of ``writers`` ((writer, topic, queue), the sequence table)
        names any more: once a writer's sequences expired, its id is anyone's again. A
        pass over the table, made when ``expired`` sequences were just forgotten or when
        there are more bindings than sequences; how many were dropped."""
        if not self._user or (not expired and len(self._user) <= len(writers)):
            return 0
        live = {k[0] for k in writers}
        gone = [w for w in self._user if w not in live and w not in self._conn]
        for w in gone:
            del self._user[w]
        return len(gone)
