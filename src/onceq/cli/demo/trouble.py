"""The trouble the demo injects: lost send replies, a SIGKILLed member, a SIGKILLed broker.

* ``ReplyDropProxy``: a loopback TCP relay between the producer and the broker that reads
  the frame headers going by and, for chosen send requests, drops the broker's reply by
  cutting the connection as the reply arrives. The message was stored; the producer sees a
  lost connection and retries with the same unique key (the broker's dedup window's job).
* ``BrokerProcess``: ``onceq broker start`` in a child process; SIGKILL and restart on the
  same port and data directory.
* ``ChildMember``: a consumer-group member in a child process, to SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

from ...protocol.codes import RequestCode
from ...protocol.frame import PREFIX, PREFIX_SIZE, REQUEST, RESPONSE

_SENDS = (RequestCode.SEND, RequestCode.SEND_BATCH, RequestCode.SEND_RECORDS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Frames:
    """Frame headers (kind, code, corr id) out of a byte stream, sans I/O."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, int]]:
        self._buf += data
        out = []
        while len(self._buf) >= PREFIX_SIZE:
            length, _ver, kind, code, corr, _hl = PREFIX.unpack_from(self._buf)
            if len(self._buf) < 4 + length:
                break
            del self._buf[:4 + length]
            out.append((kind, code, corr))
        return out


class ReplyDropProxy:
    """Relay to ``upstream``; ``drop(n)`` decides for the n-th send request (from 1) whether
    its reply is lost. ``dropped`` lists the times of the replies it dropped."""

    def __init__(self, upstream: str, drop: Callable[[int], bool]) -> None:
        self.upstream = upstream
        self.drop = drop
        self.sends = 0
        self.dropped: list[float] = []
        self.address = ""
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> ReplyDropProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                      ) -> None:
        host, port = self.upstream.rsplit(":", 1)
        try:
            up_r, up_w = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        doomed: set[int] = set()
        await asyncio.gather(self._requests(reader, up_w, doomed),
                             self._replies(up_r, writer, up_w, doomed))

    async def _requests(self, reader: asyncio.StreamReader, up_w: asyncio.StreamWriter,
                        doomed: set[int]) -> None:
        frames = _Frames()
        try:
            while data := await reader.read(65536):
                for kind, code, corr in frames.feed(data):
                    if kind == REQUEST and code in _SENDS:
                        self.sends += 1
                        if self.drop(self.sends):
                            doomed.add(corr)
                up_w.write(data)
                await up_w.drain()
        except OSError:
            pass
        finally:
            up_w.close()

    async def _replies(self, up_r: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       up_w: asyncio.StreamWriter, doomed: set[int]) -> None:
        frames = _Frames()
        try:
            while data := await up_r.read(65536):
                if any(kind == RESPONSE and corr in doomed
                       for kind, _code, corr in frames.feed(data)):
                    self.dropped.append(time.time())
                    break  # the reply (and whatever came with it) never reaches the client
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()
            up_w.close()


class BrokerProcess:
    """``onceq broker start`` in a child process on a fixed port."""

    def __init__(self, data_dir: str, args: list[str], log_path: str) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.args = args
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self, timeout: float = 30.0) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "onceq.cli.main", "broker", "start", "--data-dir",
                 self.data_dir, "--port", str(self.port), "--log-level", "WARNING",
                 *self.args], stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the broker exited (code {self.proc.returncode}); "
                                   f"see {self.log_path}")
            try:
                _r, w = await asyncio.open_connection("127.0.0.1", self.port)
                w.close()
                return
            except OSError:
                await asyncio.sleep(0.05)
        self.kill()
        raise RuntimeError(f"the broker did not start within {timeout:.0f} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


class ChildMember:
    """``python -m onceq.cli.demo.member`` in a child process."""

    def __init__(self, args: list[str], log_path: str) -> None:
        self.args = args
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, timeout: float = 30.0) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "onceq.cli.demo.member", *self.args,
                stdout=asyncio.subprocess.PIPE, stderr=log,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if line.strip() != b"ready":
            raise RuntimeError("the child member did not start")

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 15)
            await self.kill()
