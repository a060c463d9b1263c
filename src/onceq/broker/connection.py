"""One client connection: bytes in, frames out, through the sans-I/O codec."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from ..protocol.errors import ProtocolError
from ..protocol.frame import PUSH, RESPONSE, FrameDecoder, encode_frame

if TYPE_CHECKING:
    from .broker import Broker

log = logging.getLogger("onceq.broker")

_HIGH_WATER = 8 * 1024 * 1024
_FLUSH_AT = 256 * 1024


class Connection(asyncio.Protocol):
    def __init__(self, broker: Broker, max_frame: int) -> None:
        self.broker = broker
        self.decoder = FrameDecoder(max_frame)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.peer = "?"
        self.client_ids: set[str] = set()
        self._backlog: deque[tuple[int, int, int, int, bytes, bytes]] = deque()
        self._broken: ProtocolError | None = None
        self._write_paused = False
        self._out: list[bytes] = []  # frames written this loop pass (one send for all)
        self._out_size = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.transport.set_write_buffer_limits(high=_HIGH_WATER)  # type: ignore[union-attr]
        self.broker.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.closed or self._broken is not None:
            return
        self.decoder.feed(data)
        try:
            frames = self.decoder.frames()
        except ProtocolError as exc:
            self._broken = exc
        else:
            self._backlog.extend(frames)
            if self.decoder.broken is not None:
                self._broken = self.decoder.broken  # after the frames before it
        self._drain()

    def _drain(self) -> None:
        """Dispatch decoded frames until the client stops reading our answers.

        A client that pipelines requests but does not read the responses would otherwise
        make the broker buffer every answer (pulls of up to 8 MiB each) without bound.
        While the transport's write buffer is above the high-water mark, requests wait here
        and the socket is not read; they continue once the client has read enough.
        """
        backlog = self._backlog
        dispatch = self.broker.dispatch
        while backlog and not self._write_paused and not self.closed:
            _version, kind, code, corr_id, header, payload = backlog.popleft()
            dispatch(self, kind, code, corr_id, header, payload)
        if not backlog and self._broken is not None and not self.closed:
            self._protocol_error(self._broken)

    def pause_writing(self) -> None:
        self._write_paused = True
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
            self._drain()

    def _protocol_error(self, exc: ProtocolError) -> None:
        log.warning("closing connection %s: %s", self.peer, exc)
        corr = getattr(exc, "corr_id", 0)
        self.respond(corr, int(exc.code), {"message": exc.message})
        self.close()

    def respond(self, corr_id: int, code: int, header: dict[str, Any] | None = None,
                payload: bytes = b"") -> None:
        self._write(encode_frame(RESPONSE, code, corr_id, header, payload))

    def push(self, code: int, header: dict[str, Any]) -> None:
        self._write(encode_frame(PUSH, code, 0, header))

    def _write(self, frame: bytes) -> None:
        """Queue a frame; frames written in one loop pass go out in one send."""
        if self.closed or self.transport is None:
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(frame)
        self._out_size += len(frame)
        if self._out_size >= _FLUSH_AT:
            self._flush()  # large answers: hand them over now (backpressure sees them)

    def _flush(self) -> None:
        if self._out and not self.closed and self.transport is not None:
            out = self._out
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
        self._out = []
        self._out_size = 0

    def close(self) -> None:
        if not self.closed:
            self._flush()
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.broker.on_disconnect(self)
