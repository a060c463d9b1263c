"""Just enough HTTP/1.1 for etcd's JSON gateway: one POST per connection.

A unary call sends one JSON body and reads one JSON answer; a streaming call (watch) reads
the answer's chunked body as a sequence of JSON objects until the caller stops. Transport
failures raise :class:`TransportError`; the etcd client turns them into its own errors.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

_MAX_HEAD = 64 * 1024


class TransportError(Exception):
    """The endpoint could not be reached, or did not answer as HTTP should."""


def _why(e: OSError) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    return e.strerror or str(e) or type(e).__name__


class HttpStatusError(Exception):
    """The endpoint answered with a status other than 200."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


def _request(host: str, port: int, path: str, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body, separators=(",", ":")).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Content-Type: application/json\r\nAccept: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + payload


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
        raise TransportError("connection closed before an HTTP answer") from e
    if len(raw) > _MAX_HEAD:
        raise TransportError("HTTP header too large")
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise TransportError(f"not an HTTP answer: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _chunk(reader: asyncio.StreamReader) -> bytes | None:
    """The next piece of a chunked body; None at its end."""
    size_line = await reader.readuntil(b"\r\n")
    size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
    if size == 0:
        return None
    data = await reader.readexactly(size + 2)
    return data[:-2]


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    try:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            pieces = []
            while (piece := await _chunk(reader)) is not None:
                pieces.append(piece)
            return b"".join(pieces)
        if "content-length" in headers:
            return await reader.readexactly(int(headers["content-length"]))
        return await reader.read()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
        raise TransportError("HTTP body cut short") from e


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"{}")
    except ValueError as e:
        raise TransportError(f"answer is not JSON: {raw[:80]!r}") from e
    if not isinstance(value, dict):
        raise TransportError(f"answer is not a JSON object: {raw[:80]!r}")
    return value


async def _open(host: str, port: int, path: str, body: dict[str, Any]
                ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int, dict[str, str]]:
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as e:
        raise TransportError(_why(e)) from e
    try:
        writer.write(_request(host, port, path, body))
        await writer.drain()
        status, headers = await _read_head(reader)
    except BaseException as e:
        writer.close()
        if isinstance(e, OSError):
            raise TransportError(_why(e)) from e
        raise
    return reader, writer, status, headers


async def post(host: str, port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` as JSON and return the JSON answer (no timeout: the caller's)."""
    reader, writer, status, headers = await _open(host, port, path, body)
    try:
        answer = _decode(await _body(reader, headers))
    except OSError as e:
        raise TransportError(_why(e)) from e
    finally:
        writer.close()
    if status != 200:
        raise HttpStatusError(status, answer)
    return answer


class Stream:
    """An open streaming answer: ``await next_object()`` until the caller closes it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._buffer = ""
        self._decoder = json.JSONDecoder()

    async def next_object(self) -> dict[str, Any]:
        while True:
            text = self._buffer.lstrip()
            if text:
                try:
                    value, end = self._decoder.raw_decode(text)
                except ValueError:
                    pass  # an object split over chunks: read on
                else:
                    self._buffer = text[end:]
                    if not isinstance(value, dict):
                        raise TransportError("stream item is not a JSON object")
                    return value
            try:
                chunk = await _chunk(self._reader)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                    OSError) as e:
                raise TransportError("stream cut short") from e
            if chunk is None:
                raise TransportError("stream ended")
            self._buffer = text + chunk.decode()

    def close(self) -> None:
        self._writer.close()


async def open_stream(host: str, port: int, path: str, body: dict[str, Any]) -> Stream:
    """POST ``body`` and return the streaming answer (chunked JSON objects)."""
    reader, writer, status, headers = await _open(host, port, path, body)
    if status != 200:
        try:
            answer = _decode(await _body(reader, headers))
        finally:
            writer.close()
        raise HttpStatusError(status, answer)
    if "chunked" not in headers.get("transfer-encoding", "").lower():
        writer.close()
        raise TransportError("streaming answer is not chunked")
    return Stream(reader, writer)
