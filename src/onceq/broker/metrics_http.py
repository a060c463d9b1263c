"""The bounded HTTP/1.1 server behind the metrics port (see ``metrics.py`` for the limits).

One request per connection: the request head is read under one deadline from accept to
its end and one size cap, the answer is written under a write timeout, then the connection
is closed (``Connection: close``, no keep-alive). At most ``max_connections`` connections
are open at once; when a new one arrives at the cap, the connection open longest that is
not being answered (still sending its head, or not reading its answer) is closed to make
room, so connections that never finish cannot keep a normal scrape out. Only when every
slot is busy rendering an answer is the new one refused (``503``, then close).

An error answer (``408``, ``431``, ``503``) is followed by a lingering close: our side is
shut down and what the client still sends is read and dropped for at most ``LINGER_S``, so
the answer is not lost to a reset caused by unread input.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from ssl import SSLContext

log = logging.getLogger("onceq.broker.metrics")

LOG_EVERY_S = 10.0  # at most one log line about closed or refused connections per period
LINGER_S = 1.0  # after an error answer, input is read and dropped this long at most

# phases of a connection; all but RENDER may be closed at the cap to make room
HEAD, RENDER, WRITE, LINGER = "head", "render", "write", "linger"


@dataclass(frozen=True)
class HttpLimits:
    max_connections: int = 64  # open connections at once (at least 1)
    head_deadline_s: float = 5.0  # accept -> end of the request head
    max_head_bytes: int = 8192  # request line and headers together
    write_timeout_s: float = 10.0  # the answer handed to the kernel within this

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_head_bytes < 64:
            raise ValueError("max_connections must be >= 1 and max_head_bytes >= 64")
        if self.head_deadline_s <= 0 or self.write_timeout_s <= 0:
            raise ValueError("head_deadline_s and write_timeout_s must be > 0")


class _Slot:
    __slots__ = ("accepted_at", "phase", "task", "writer")

    def __init__(self, writer: asyncio.StreamWriter, now: float) -> None:
        self.writer = writer
        self.accepted_at = now
        self.phase = HEAD
        self.task = asyncio.current_task()


class _HeadTooLarge(Exception):
    pass


# method, path -> status line, content type, body
Handler = Callable[[bytes, bytes], Awaitable[tuple[str, str, bytes]]]


def _response(status: str, ctype: str, body: bytes, head_only: bool = False,
              extra: str = "") -> bytes:
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n").encode()
    return head if head_only else head + body


_TIMEOUT = _response("408 Request Timeout", "text/plain", b"request head too slow\n")
_TOO_LARGE = _response("431 Request Header Fields Too Large", "text/plain",
                       b"request head too large\n")
_BUSY = _response("503 Service Unavailable", "text/plain", b"too many connections\n",
                  extra="Retry-After: 1\r\n")


class MetricsHttpServer:
    def __init__(self, handler: Handler, limits: HttpLimits,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.handler = handler
        self.limits = limits
        self.clock = clock
        self.slots: dict[asyncio.StreamWriter, _Slot] = {}
        # totals, for logs and tests
        self.evicted = 0  # closed at the cap to make room for a new connection
        self.refused = 0  # new connections refused: every slot busy rendering
        self.timed_out = 0  # request head not complete within the deadline
        self.too_large = 0  # request head over the size cap
        self.write_timeouts = 0  # answer not read by the client within the write timeout
        self._server: asyncio.AbstractServer | None = None
        self._refusing: set[asyncio.StreamWriter] = set()  # refused, lingering
        self._logged_at = -LOG_EVERY_S
        self._unlogged: dict[str, int] = {}

    @property
    def open_connections(self) -> int:
        return len(self.slots)

    async def start(self, host: str, port: int, ssl: SSLContext | None = None) -> int:
        # the stream limit bounds one header line and what is buffered ahead of it
        self._server = await asyncio.start_server(
            self._serve, host, port, reuse_address=True,
            limit=self.limits.max_head_bytes + 2, ssl=ssl,
            ssl_handshake_timeout=self.limits.head_deadline_s if ssl else None)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            tasks = [s.task for s in self.slots.values() if s.task is not None]
            for writer in [*(s.writer for s in self.slots.values()), *self._refusing]:
                writer.transport.abort()
            self.slots.clear()
            self._refusing.clear()
            for t in tasks:  # e.g. rendering: the answer is not wanted any more
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=1.0)
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    # ------------------------------------------------------------------ admission
    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        """Make room for ``writer`` at the cap (closing the oldest evictable connection),
        or refuse it (False) when every slot is rendering an answer."""
        if len(self.slots) >= self.limits.max_connections:
            victim = min((s for s in self.slots.values() if s.phase != RENDER),
                         key=lambda s: s.accepted_at, default=None)
            if victim is None:
                self.refused += 1
                self._note("refused (every slot rendering)")
                return False
            self.evicted += 1
            self._note(f"closed at the cap ({victim.phase})")
            del self.slots[victim.writer]
            victim.writer.transport.abort()
        self.slots[writer] = _Slot(writer, self.clock())
        return True

    def _note(self, what: str) -> None:
        """Count and (rate-limited) log connections closed or refused by a limit."""
        self._unlogged[what] = self._unlogged.get(what, 0) + 1
        now = self.clock()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning("metrics port: %s (limits: %d connections, %gs request head "
                        "deadline, %d bytes request head, %gs write timeout)",
                        ", ".join(f"{n} {w}" for w, n in self._unlogged.items()),
                        self.limits.max_connections, self.limits.head_deadline_s,
                        self.limits.max_head_bytes, self.limits.write_timeout_s)
            self._logged_at = now
            self._unlogged.clear()

    # ------------------------------------------------------------------ one request
    async def _read_head(self, reader: asyncio.StreamReader) -> bytes | None:
        """The request line, once the head is complete; None at end of input."""
        max_head = self.limits.max_head_bytes
        try:
            request = await reader.readline()
            size = len(request)
            line = request
            while line not in (b"\r\n", b"\n"):
                if size > max_head:
                    raise _HeadTooLarge
                if not line.endswith(b"\n"):
                    return None  # end of input inside the head
                line = await reader.readline()
                size += len(line)
        except ValueError:  # one line over the stream limit
            raise _HeadTooLarge from None
        if size > max_head:
            raise _HeadTooLarge
        return request

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      answer: bytes) -> None:
        """Send a small error answer, shut our side down, and drop what the client still
        sends until it closes too (at most ``LINGER_S``)."""
        writer.write(answer)  # small: fits the socket buffer, never waited for
        writer.write_eof()
        async with asyncio.timeout(LINGER_S):
            while await reader.read(65536):
                pass

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                      ) -> None:
        if len(self._refusing) >= self.limits.max_connections:
            writer.transport.abort()  # a flood of them: no lingering
            return
        self._refusing.add(writer)
        try:
            await self._linger(reader, writer, _BUSY)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            self._refusing.discard(writer)
            writer.transport.abort()  # fine now: the answer went out long ago

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                     ) -> None:
        if not self._admit(writer):
            await self._refuse(reader, writer)
            return
        slot = self.slots[writer]
        limits = self.limits
        abort = False
        try:
            try:
                left = limits.head_deadline_s - (self.clock() - slot.accepted_at)
                async with asyncio.timeout(max(0.0, left)):
                    request = await self._read_head(reader)
            except TimeoutError:
                self.timed_out += 1
                self._note("request head deadline passed")
                slot.phase = LINGER
                await self._linger(reader, writer, _TIMEOUT)
                return
            except _HeadTooLarge:
                self.too_large += 1
                self._note("request head too large")
                slot.phase = LINGER
                await self._linger(reader, writer, _TOO_LARGE)
                return
            if request is None:
                return
            parts = request.split()
            method = parts[0] if parts else b""
            path = parts[1].split(b"?")[0] if len(parts) > 1 else b""
            slot.phase = RENDER
            status, ctype, body = await self.handler(method, path)
            slot.phase = WRITE
            # drain waits until all is handed to the kernel, then closing is immediate
            writer.transport.set_write_buffer_limits(high=0)
            writer.write(_response(status, ctype, body, head_only=method == b"HEAD"))
            try:
                async with asyncio.timeout(limits.write_timeout_s):
                    await writer.drain()
            except TimeoutError:
                self.write_timeouts += 1
                self._note("answer not read within the write timeout")
                abort = True
        except (ConnectionError, TimeoutError):  # reset, or lingered long enough
            abort = True
        except asyncio.CancelledError:
            # stop(): ended here, as Python 3.11's stream callback logs a cancelled handler
            abort = True
        except Exception:
            log.exception("metrics request failed")
            abort = True
        finally:
            if self.slots.get(writer) is slot:
                del self.slots[writer]
            if abort:
                writer.transport.abort()
            else:
                writer.close()
