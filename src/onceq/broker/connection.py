"""One client connection: bytes in, frames out, through the sans-I/O codec."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from ..protocol.errors import ErrorCode, ProtocolError
from ..protocol.frame import PUSH, RESPONSE, FrameDecoder, encode_frame, encode_frame_head
from .config import WRITE_HIGH_WATER

if TYPE_CHECKING:
    from ..protocol.schema import Message
    from .broker import Broker

log = logging.getLogger("onceq.broker")

# what one held pull costs the broker (request, timer, its answer's header), counted
# against ``max_output``: a client cannot park pulls without bound either
HELD_PULL_COST = 2048
HIGH_WATER = WRITE_HIGH_WATER  # stop dispatching a client's requests above this much output
_FLUSH_AT = 256 * 1024
_PAYLOAD_APART = 8 * 1024  # larger payloads are not copied behind their frame's head


class Connection(asyncio.Protocol):
    def __init__(self, broker: Broker, max_frame: int, max_output: int) -> None:
        self.broker = broker
        self.decoder = FrameDecoder(max_frame)
        self.max_output = max_output
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.peer = "?"
        self.source: str | None = None  # the peer's address (ACL source conditions)
        self.user: str | None = None  # who authenticated on this connection (security.py)
        self.scram: Any = None  # a SCRAM exchange under way (its server side)
        self.client_ids: set[str] = set()
        self.writer_ids: set[str] = set()  # idempotent writers sending on it (writer_ids.py)
        self.refused = False  # over the connection cap: answered and closed at once
        self.guard = broker.guard
        self.buffered = 0  # bytes of a partial frame, counted in guard.input_buffered
        self.input_blocked = False  # not read while partial frames take the whole budget
        self._backlog: deque[tuple[int, int, int, int, bytes, bytes]] = deque()
        self._broken: ProtocolError | None = None
        self._write_paused = False
        self._out: list[bytes] = []  # frames written this loop pass (one send for all)
        self._out_size = 0
        # GROUP_CHANGED and other pushes not sent yet, the latest per (code, group)
        self._pushes: dict[tuple[int, Any], dict[str, Any]] = {}
        self.deferred_pulls = False  # held pulls kept waiting while writing was paused
        self.held_pulls = 0  # long-poll pulls of this client held by the broker
        # counters and marks for the periodic sweep (broker/limits.py)
        self.activity = 0  # reads, and resumed writing (the client read our answers)
        self.frames_in = 0
        self.active_mark = -1
        self.active_at = 0.0
        self.partial_mark = -1
        self.partial_at: float | None = None
        self.closed_at: float | None = None  # closed by the broker, output still unsent

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.source = peer[0] if isinstance(peer, tuple) else None
        broker = self.broker
        if not broker.guard.admit(len(broker.connections), self.peer):
            self.closed = self.refused = True  # never a member nor a puller
            transport.write(encode_frame(  # type: ignore[attr-defined]
                RESPONSE, int(ErrorCode.TOO_MANY_CONNECTIONS), 0,
                {"message": "too many connections: try again later"}))
            transport.close()
            return
        self.transport.set_write_buffer_limits(high=HIGH_WATER)  # type: ignore[union-attr]
        broker.connections.add(self)
        cert = transport.get_extra_info("peercert")  # verified by TLS (mTLS)
        if cert:
            broker.security.certificate_user(self, _common_name(cert))

    def data_received(self, data: bytes) -> None:
        if self.closed or self._broken is not None:
            return
        self.activity += 1
        decoder = self.decoder
        decoder.feed(data)
        try:
            frames = decoder.frames()
        except ProtocolError as exc:
            self._broken = exc
        else:
            self.frames_in += len(frames)
            self._backlog.extend(frames)
            if decoder.broken is not None:
                self._broken = decoder.broken  # after the frames before it
        buffered = decoder.buffered
        if buffered != self.buffered:
            if self.guard.input_changed(self.buffered, buffered):
                self.block_input()
            self.buffered = buffered
        self._drain()

    def block_input(self) -> None:
        """Stop reading: partial frames of all connections hold the whole input budget and
        this one holds more than its share. It is read again once the total is below the
        budget (``guard.unblock``, on every sweep and connection end); its read timeout
        keeps running meanwhile."""
        if not self.input_blocked and self.transport is not None and not self.closed:
            self.input_blocked = True
            self.guard.blocked.add(self)
            self.transport.pause_reading()

    def unblock_input(self) -> None:
        self.input_blocked = False
        if self.transport is not None and not self.closed and not self._write_paused:
            self.transport.resume_reading()

    def _forget_input(self) -> None:
        """The connection ends: its partial frame no longer counts."""
        guard = self.guard
        guard.input_changed(self.buffered, 0)
        self.buffered = 0
        self.input_blocked = False
        guard.blocked.discard(self)
        guard.unblock()

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

    @property
    def write_paused(self) -> bool:
        return self._write_paused

    def pending_output(self) -> int:
        """Bytes queued for this client: the transport's buffer and frames not handed over."""
        t = self.transport
        return self._out_size + (t.get_write_buffer_size() if t is not None else 0)

    def pause_writing(self) -> None:
        self._write_paused = True
        self.guard.write_paused.add(self)
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self.guard.write_paused.discard(self)
        if self.transport is not None and not self.closed:
            self.activity += 1  # the client reads: not idle
            if not self.input_blocked:
                self.transport.resume_reading()
            self.send_pushes()
            if self.deferred_pulls:  # answers that waited for the client to read
                self.deferred_pulls = False
                self.broker.holds.notify_connection(self)
            self._drain()

    def _protocol_error(self, exc: ProtocolError) -> None:
        log.warning("closing connection %s: %s", self.peer, exc)
        corr = getattr(exc, "corr_id", 0)
        self.respond(corr, int(exc.code), {"message": exc.message})
        self.close()

    def respond(self, corr_id: int, code: int, header: dict[str, Any] | None = None,
                payload: bytes = b"") -> None:
        try:
            head = encode_frame_head(RESPONSE, code, corr_id, header, len(payload))
        except (TypeError, ValueError, OverflowError) as exc:
            # a header no frame can carry: the client still gets an answer, the error
            log.error("answer to request %d cannot be encoded: %s", corr_id, exc)
            self._write(encode_frame(RESPONSE, ErrorCode.SYSTEM_ERROR, corr_id,
                                     {"message": f"internal: answer not encodable: {exc}"}))
            return
        if len(payload) < _PAYLOAD_APART:
            self._write(head + payload)
        else:  # a pull's records: written as read from the log, behind the frame's head
            self._write(head, payload)

    def answer(self, corr_id: int, reply: Message) -> None:
        """Answer a request with its typed reply (in a broker group, tagged with the
        leader's epoch: clients refuse answers of a leader older than one they saw)."""
        header = reply.encode()
        cluster = self.broker.cluster
        if cluster is not None and (epoch := cluster.answer_epoch()):
            header["ep"] = epoch
        self.respond(corr_id, 0, header, getattr(reply, "payload", b""))

    def push(self, message: Message) -> None:
        """Queue a one-way push. Pushes of one code and group (or topic) coalesce: while one is not
        sent yet, a later one replaces it (only the latest state matters to the client)."""
        if self.closed or self.transport is None:
            return
        if not self._pushes:
            asyncio.get_running_loop().call_soon(self.send_pushes)
        about = getattr(message, "group", None) or getattr(message, "topic", None)
        self._pushes[(message.CODE, about)] = message.encode()

    def send_pushes(self, force: bool = False) -> None:
        """Write the waiting pushes (with the frames of this loop pass), unless the socket
        still has output unsent: then they wait (coalescing) for the next sweep, which sends
        them anyway (``force``). A client that does not read thus gets at most one push per
        group and sweep, not one per change (each small write queued costs the broker far
        more than its bytes)."""
        if not self._pushes:
            return
        if self.closed or self.transport is None:
            self._pushes.clear()
            return
        if not force and self.transport.get_write_buffer_size():
            return
        self._add_pushes()

    def _add_pushes(self) -> None:
        pushes, self._pushes = self._pushes, {}
        for (code, _group), header in pushes.items():
            frame = encode_frame(PUSH, code, 0, header)
            if not self._out:
                asyncio.get_running_loop().call_soon(self._flush)
            self._out.append(frame)
            self._out_size += len(frame)

    def write_frame(self, frame: bytes) -> None:
        """Queue a frame made elsewhere (a reply pushed to its requester, ``reply_route.py``):
        written with this loop pass's answers, under the connection's output limits."""
        self._write(frame)

    def _write(self, frame: bytes, payload: bytes = b"") -> None:
        """Queue a frame (its head and payload, when apart); frames written in one loop
        pass go out in one write."""
        if self.closed or self.transport is None:
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(frame)
        self._out_size += len(frame)
        if payload:
            self._out.append(payload)
            self._out_size += len(payload)
        if self._out_size >= _FLUSH_AT:
            self._flush()  # large answers: hand them over now (backpressure sees them)

    def _flush(self) -> None:
        if self._pushes and self.transport is not None and not self.closed \
                and not self.transport.get_write_buffer_size():
            self._add_pushes()  # waiting pushes go with these answers: the socket drained
        out = self._out
        self._out = []
        self._out_size = 0
        if out and not self.closed and self.transport is not None:
            if len(out) == 1:
                self.transport.write(out[0])
            else:  # one vectored write (uvloop), no copy into one buffer
                self.transport.writelines(out)
            if self._write_paused:  # above the high-water mark: is it above the limit?
                self._check_output()
                self.guard.check_output()

    def held_pull_added(self) -> None:
        if self.held_pulls * HELD_PULL_COST > self.max_output:
            self.abort(f"too many held pulls: {self.held_pulls} held, each counted as "
                       f"{HELD_PULL_COST} bytes against the output limit of {self.max_output} "
                       f"bytes", logging.WARNING)

    def _check_output(self) -> None:
        """A client with more than ``max_output`` bytes queued is a slow consumer: drop it
        (its unread output with it) rather than let it hold the broker's memory."""
        pending = self.pending_output()
        if pending > self.max_output:
            self.abort(f"slow consumer: {pending} bytes of output queued, above the limit "
                       f"of {self.max_output} bytes", logging.WARNING)

    def abort(self, reason: str, level: int = logging.WARNING) -> None:
        """Close at once, dropping unsent output; the disconnect releases the client's
        group memberships, access locks and held pulls as any disconnect does."""
        if self.closed:
            return
        log.log(level, "closing connection %s: %s", self.peer, reason)
        self.closed = True
        self.guard.write_paused.discard(self)
        self._out = []
        self._out_size = 0
        self._pushes.clear()
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """Close once the output is sent (the sweep aborts it if the client does not read
        that output within ``CLOSE_GRACE_S``)."""
        if not self.closed:
            self._flush()
            self.closed = True
            self.closed_at = self.guard.clock()
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.guard.write_paused.discard(self)
        if not self.refused:
            self._forget_input()
            self.broker.on_disconnect(self)


def _common_name(cert: dict[str, Any]) -> str | None:
    """The subject CN of a certificate as ``ssl`` gives it (``getpeercert``)."""
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None
