"""One client connection: bytes in, frames out, through the sans-I/O codec."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ..protocol.errors import ProtocolError
from ..protocol.frame import PUSH, RESPONSE, FrameDecoder, encode_frame

if TYPE_CHECKING:
    from .broker import Broker

log = logging.getLogger("onceq.broker")

_HIGH_WATER = 8 * 1024 * 1024


class Connection(asyncio.Protocol):
    def __init__(self, broker: Broker, max_frame: int) -> None:
        self.broker = broker
        self.decoder = FrameDecoder(max_frame)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.peer = "?"
        self.client_ids: set[str] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.transport.set_write_buffer_limits(high=_HIGH_WATER)  # type: ignore[union-attr]
        self.broker.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.decoder.feed(data)
        try:
            frames = self.decoder.frames()
        except ProtocolError as exc:
            self._protocol_error(exc)
            return
        dispatch = self.broker.dispatch
        for _version, kind, code, corr_id, header, payload in frames:
            dispatch(self, kind, code, corr_id, header, payload)
            if self.closed:
                return
        if self.decoder.broken is not None:
            self._protocol_error(self.decoder.broken)

    def _protocol_error(self, exc: ProtocolError) -> None:
        log.warning("closing connection %s: %s", self.peer, exc)
        corr = getattr(exc, "corr_id", 0)
        self.respond(corr, int(exc.code), {"message": exc.message})
        self.close()

    def respond(self, corr_id: int, code: int, header: dict[str, Any] | None = None,
                payload: bytes = b"") -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(encode_frame(RESPONSE, code, corr_id, header, payload))

    def push(self, code: int, header: dict[str, Any]) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(encode_frame(PUSH, code, 0, header))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.broker.on_disconnect(self)
