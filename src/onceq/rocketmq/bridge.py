"""The RocketMQ front end's way into the broker: the same services and typed requests as
onceq's own frames (``Broker.handlers``: request code -> its type and handler), answered
to a connection of its own instead of a socket.

``FrontConnection`` stands where a ``broker/connection.py`` connection stands for the
services: ``answer`` and ``respond`` resolve the future of the request they answer,
``push`` (group change notices) is dropped, and the attributes the held pulls and the
member registry read are there. ``Bridge.call`` runs one typed request and returns its
typed reply, or raises its ``OnceqError``; a reply given later (after an fsync, or a held
pull woken by a message) is awaited.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Any

from ..broker.fields import Call
from ..broker.store_errors import StorageError, wire_error
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.schema import Message

if TYPE_CHECKING:
    from ..broker.broker import Broker


class FrontConnection:
    """A connection of the front end as the broker's services see it."""

    def __init__(self, peer: str, user: str | None = None) -> None:
        self.peer = peer
        self.user = user
        self.closed = False
        self.write_paused = False
        self.deferred_pulls = False
        self.held_pulls = 0
        self.client_ids: set[str] = set()
        self._waiting: dict[int, asyncio.Future[Message]] = {}
        self._corr = itertools.count(1)

    # ---------------------------------------------------------------- for the front end
    def expect(self) -> tuple[int, asyncio.Future[Message]]:
        corr = next(self._corr)
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiting[corr] = fut
        return corr, fut

    def forget(self, corr: int) -> None:
        fut = self._waiting.pop(corr, None)
        if fut is not None and not fut.done():
            fut.cancel()

    def close(self) -> None:
        self.closed = True
        for corr in list(self._waiting):
            self.forget(corr)

    # ---------------------------------------------------------------- for the services
    def answer(self, corr_id: int, reply: Message) -> None:
        fut = self._waiting.pop(corr_id, None)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def respond(self, corr_id: int, code: int, header: dict[str, Any] | None = None,
                payload: bytes = b"") -> None:
        fut = self._waiting.pop(corr_id, None)
        if fut is not None and not fut.done():
            message = None if header is None else header.get("message")
            fut.set_exception(OnceqError(code, message if isinstance(message, str) else None))

    def push(self, message: Message) -> None:
        """Notices to members (a group changed): RocketMQ clients poll instead."""

    def held_pull_added(self) -> None:
        """The held-pull count of a socket connection is bounded there; the front end
        holds at most one pull per queue of the topic a receive waits on."""


class Bridge:
    """Typed calls into one broker's services."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.closing = False

    def submit(self, conn: FrontConnection, request: Message
               ) -> tuple[Message | None, int, asyncio.Future[Message]]:
        """Run ``request`` now; returns (its reply, or None when it answers later to the
        future, with the correlation id to ``forget`` it by)."""
        if self.closing:
            raise OnceqError(ErrorCode.SHUTTING_DOWN)
        broker = self.broker
        if broker.cluster is not None:  # a follower serves no client (NOT_LEADER)
            broker.cluster.admit(request.CODE)
        _cls, handler = broker.handlers[request.CODE]
        corr, fut = conn.expect()
        try:
            reply = handler(Call(conn, corr), request)  # type: ignore[arg-type]
        except StorageError as exc:
            conn.forget(corr)
            raise wire_error(exc) from None
        except BaseException:
            conn.forget(corr)
            raise
        if reply is not None:
            conn.forget(corr)
        return reply, corr, fut

    async def call(self, conn: FrontConnection, request: Message) -> Message:
        """The typed reply of ``request`` (awaited when the service answers later)."""
        reply, corr, fut = self.submit(conn, request)
        if reply is not None:
            return reply
        try:
            return await fut
        finally:
            conn.forget(corr)
