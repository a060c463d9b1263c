"""Which connection a client id belongs to.

A client names itself (``client``) in its heartbeats, pulls, commits and lock requests, and
the queue-ownership rules trust that name. A name alone is only a claim: the broker binds
each client id to the connection whose heartbeat first named it, until that connection
closes, and refuses a request naming the id from any other connection with
``CLIENT_ID_IN_USE`` (retriable: a client that reconnects is served again once the broker
has seen its old connection close). Another connection can thus neither take over a
member, nor release, unlock or commit in its name, nor pull under its lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..protocol.codes import RequestCode
from ..protocol.errors import ErrorCode, OnceqError

if TYPE_CHECKING:
    from .connection import Connection

# requests whose ``client`` field is checked against the connection that owns the id
CLAIMING = frozenset({RequestCode.HEARTBEAT, RequestCode.UNREGISTER, RequestCode.PULL,
                      RequestCode.COMMIT_OFFSET, RequestCode.LOCK_QUEUES,
                      RequestCode.UNLOCK_QUEUES, RequestCode.RELEASE_QUEUE})


class ClientIds:
    def __init__(self) -> None:
        self._owner: dict[str, Connection] = {}

    def check(self, conn: Connection, client: str | None) -> None:
        """Refuse a request of ``conn`` that names a client id another connection owns."""
        if client is None:
            return
        owner = self._owner.get(client)
        if owner is not None and owner is not conn and not owner.closed:
            raise OnceqError(ErrorCode.CLIENT_ID_IN_USE, f"client id {client!r} belongs to "
                             f"another connection ({owner.peer})")

    def bind(self, conn: Connection, client: str) -> None:
        """``conn``'s heartbeat named ``client`` (after ``check``): it owns the id now."""
        self._owner[client] = conn

    def drop(self, conn: Connection) -> None:
        """``conn`` closed: the ids it owned are free."""
        for client in conn.client_ids:
            if self._owner.get(client) is conn:
                del self._owner[client]
