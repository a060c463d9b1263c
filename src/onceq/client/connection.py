"""Client side of one broker connection: requests with correlation ids, server pushes."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any, Protocol

from ..protocol.errors import ErrorCode, OnceqError, ProtocolError
from ..protocol.frame import (
    PUSH,
    REQUEST,
    RESPONSE,
    FrameDecoder,
    decode_header,
    encode_frame,
    max_frame_for_body,
)
from ..protocol.replies import REPLY_OF
from ..protocol.requests import Authenticate
from ..protocol.schema import Message
from ..protocol.scram import ScramClient, ScramError
from .security import ClientSecurity

log = logging.getLogger("onceq.client")

DEFAULT_MAX_FRAME = max_frame_for_body(64 * 1024 * 1024)
# answers after which the broker closes the connection (see broker/connection.py)
_STREAM_ERRORS = frozenset({ErrorCode.FRAME_TOO_LARGE, ErrorCode.UNSUPPORTED_VERSION})


class ConnectionLost(OnceqError):
    """The connection closed or timed out before the reply: the request may or may not have
    been carried out (retry relies on the broker's dedup window)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.SERVICE_UNAVAILABLE) -> None:
        super().__init__(code, message)


def retriable(exc: OnceqError) -> bool:
    """Whether trying again may succeed: a retriable code, or a lost connection."""
    return exc.retriable or isinstance(exc, ConnectionLost)


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"broker address must be host:port, not {address!r}")
    return host, int(port)


class EpochFence(Protocol):
    epoch: int  # the highest leader epoch seen


class BrokerConnection(asyncio.Protocol):
    def __init__(self, on_push: Callable[[int, dict[str, Any]], None] | None = None) -> None:
        self._decoder = FrameDecoder(DEFAULT_MAX_FRAME)
        # correlation id -> the answer's future and the reply type it is decoded into
        # (None: the raw header map and payload)
        self._pending: dict[int, tuple[asyncio.Future[Any], type[Message] | None]] = {}
        self._ids = itertools.count(1)
        self._transport: asyncio.Transport | None = None
        self._out: list[bytes] = []
        self._on_push = on_push
        self.closed = False
        self.user: str | None = None  # authenticated as (``authenticate``)
        self.error: OnceqError | None = None  # why the connection failed
        # in a broker group: the highest leader epoch the client has seen (its route,
        # ``route.py``); an answer from an older leader is refused (``_stale``)
        self.fence: EpochFence | None = None
        self.lost = asyncio.get_event_loop().create_future()

    @classmethod
    async def open(
        cls, address: str, on_push: Callable[[int, dict[str, Any]], None] | None = None,
        timeout: float = 3.0, security: ClientSecurity | None = None,
    ) -> BrokerConnection:
        """Connect (with TLS when ``security`` says so) and, with a user, authenticate
        (SCRAM-SHA-256) before the connection is handed out. ``security`` None: from the
        environment (``client/security.py``)."""
        sec = ClientSecurity.from_env() if security is None else security
        host, port = parse_address(address)
        loop = asyncio.get_running_loop()
        ctx = sec.ssl_context()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(lambda: cls(on_push), host, port, ssl=ctx,
                                       server_hostname=host if ctx else None), timeout
            )
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            raise ConnectionLost(f"cannot connect to broker at {address}: {exc}") from None
        if sec.user is not None:
            try:
                await proto.authenticate(sec.user, sec.password or "")
            except BaseException:
                proto.close()
                raise
        return proto

    async def authenticate(self, user: str, password: str) -> None:
        """Prove to the broker that this is ``user``, and that the broker knows the user's
        credentials (the server's signature is verified): ``AUTH_FAILED`` otherwise."""
        scram = ScramClient(user, password)
        try:
            first = await call(self, Authenticate(scram.first()))
            final = await call(self, Authenticate(scram.final(first.message)))
            scram.verify(final.message)
        except ScramError as exc:
            raise OnceqError(ErrorCode.AUTH_FAILED, f"the broker's answer does not prove "
                             f"it knows the user: {exc}") from None
        self.user = user

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._decoder.feed(data)
        try:
            frames = self._decoder.frames()
        except ProtocolError as exc:
            self._fail(ConnectionLost(f"broker sent a malformed stream: {exc}"))
            return
        for _v, kind, code, corr_id, header, payload in frames:
            if kind == RESPONSE:
                if corr_id == 0 and code:  # about the connection (e.g. TOO_MANY_CONNECTIONS)
                    try:
                        message = str(decode_header(header).get("message", ""))
                    except ValueError:
                        message = ""
                    err = OnceqError(code, message or None)
                    self._fail(ConnectionLost(f"broker closed the connection: {err.message}",
                                              err.code))
                    return
                entry = self._pending.pop(corr_id, None)
                if entry is None or entry[0].done():
                    continue
                fut, reply_type = entry
                try:
                    hdr = decode_header(header)
                except ValueError as exc:
                    fut.set_exception(OnceqError(ErrorCode.BAD_REQUEST, str(exc)))
                    continue
                if code:
                    details = {k: v for k, v in hdr.items() if k != "message"}
                    fut.set_exception(OnceqError(code, hdr.get("message"), details))
                    if code in _STREAM_ERRORS:
                        # the broker closes a stream it cannot frame: do not reuse it
                        self._fail(ConnectionLost(f"broker closed the connection: "
                                                  f"{ErrorCode(code).name}"))
                        return
                elif self.fence is not None and "ep" in hdr and self._stale(hdr["ep"]):
                    fut.set_exception(OnceqError(ErrorCode.NOT_LEADER, (
                        f"an answer from leader epoch {hdr['ep']}, older than epoch "
                        f"{self.fence.epoch} the client has seen: the broker no longer "
                        "leads its group")))
                elif reply_type is None:
                    fut.set_result((hdr, payload))
                else:
                    try:
                        fut.set_result(reply_type.decode(hdr, payload))
                    except OnceqError as err:  # a reply that does not decode
                        fut.set_exception(err)
            elif kind == PUSH and self._on_push is not None:
                try:
                    self._on_push(code, decode_header(header))
                except Exception:  # a failing handler must not take the connection down
                    log.exception("push handler failed for push code %d", code)

    def _stale(self, epoch: object) -> bool:
        """Whether an answer of a leader of ``epoch`` comes from an older leader than one
        the client has seen (the fence moves up to it otherwise)."""
        fence = self.fence
        assert fence is not None
        if type(epoch) is not int:
            return False
        if epoch < fence.epoch:
            return True
        fence.epoch = epoch
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionLost(f"connection to broker lost{': ' + str(exc) if exc else ''}"))

    def _fail(self, err: OnceqError) -> None:
        self.closed = True
        if self.error is None:
            self.error = err
        pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(err)
        if not self.lost.done():
            self.lost.set_result(None)
        if self._transport is not None:
            self._transport.close()

    def send_request(self, code: int, header: dict[str, Any] | None, payload: bytes = b"",
                     reply_type: type[Message] | None = None) -> asyncio.Future[Any]:
        """Send a request now; the future of its answer: the raw header map and payload,
        or with ``reply_type`` the typed reply."""
        if self.closed:
            if self.error is not None and self.error.code != ErrorCode.SERVICE_UNAVAILABLE:
                raise self.error  # e.g. refused: TOO_MANY_CONNECTIONS
            raise ConnectionLost("connection to broker is closed")
        corr = next(self._ids) & 0xFFFFFFFF or 1  # 0 is for answers about the connection
        fut = asyncio.get_running_loop().create_future()
        self._pending[corr] = (fut, reply_type)
        frame = encode_frame(REQUEST, code, corr, header, payload)
        if not self._out:  # requests made in one loop pass go out in one send
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(frame)
        return fut

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and not self.closed and self._transport is not None:
            self._transport.write(out[0] if len(out) == 1 else b"".join(out))

    async def request(self, code: int, header: dict[str, Any] | None = None,
                      payload: bytes = b"", timeout: float | None = 10.0
                      ) -> tuple[dict[str, Any], bytes]:
        fut = self.send_request(code, header, payload)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise ConnectionLost(f"no reply within {timeout}s") from None
        finally:
            if fut.cancelled():  # given up (timeout, cancelled caller): forget the request
                self._forget(fut)

    async def call(self, request: Message, timeout: float | None = 10.0) -> Any:
        """Send a typed request; return its typed reply (``protocol/replies.py``,
        ``REPLY_OF``), or raise its error."""
        return await call(self, request, timeout)

    def submit(self, request: Message) -> asyncio.Future[Any]:
        """Send a typed request now; a future of its typed reply (for pipelining: several
        requests in flight on one connection). A cancelled future's answer is dropped when it
        comes (the broker answers every request, and a lost connection drops them all)."""
        return self.send_request(request.CODE, request.encode(),
                                 getattr(request, "payload", b""), REPLY_OF[request.CODE])

    def _forget(self, fut: asyncio.Future[Any]) -> None:
        for corr in [c for c, (f, _) in self._pending.items() if f is fut]:
            del self._pending[corr]

    def call_oneway(self, request: Message) -> None:
        """Send a typed request and ignore its reply (fire-and-forget)."""
        self.write_oneway(request.CODE, request.encode(), getattr(request, "payload", b""))

    @property
    def pending(self) -> int:
        """Requests waiting for their reply."""
        return len(self._pending)

    def write_oneway(self, code: int, header: dict[str, Any] | None, payload: bytes = b""
                     ) -> None:
        """Send a request and ignore its reply (fire-and-forget)."""
        fut = self.send_request(code, header, payload)
        fut.add_done_callback(_swallow)

    def close(self) -> None:
        self._flush()  # requests written this loop pass (a fire-and-forget send) still go
        self._fail(ConnectionLost("connection closed by client"))


class Requests(Protocol):
    """What a typed call needs of a connection (``BrokerConnection``, or a test's fake)."""

    async def request(self, code: int, header: dict[str, Any] | None = None,
                      payload: bytes = b"", timeout: float | None = 10.0
                      ) -> tuple[dict[str, Any], bytes]: ...


async def call(conn: Requests, request: Message, timeout: float | None = 10.0) -> Any:
    """Send the typed ``request`` on ``conn``; its typed reply, or raise its error."""
    header, payload = await conn.request(request.CODE, request.encode(),
                                         getattr(request, "payload", b""), timeout)
    return REPLY_OF[request.CODE].decode(header, payload)


def _swallow(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
