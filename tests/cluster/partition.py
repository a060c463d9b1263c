"""A TCP proxy on loopback that the test can cut, to partition a client from etcd.

While cut, the proxy accepts connections and swallows what either side sends (as a
network that drops packets: calls hang until their timeout); when healed, the connections
opened before are closed and new ones pass again.
"""

from __future__ import annotations

import asyncio
import contextlib


class PartitionProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.cut = False
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> PartitionProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def partition(self) -> None:
        self.cut = True

    def heal(self) -> None:
        self.cut = False
        for writer in list(self._writers):
            writer.close()

    async def close(self) -> None:
        self.heal()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        upstream_writer = None
        try:
            if self.cut:  # hold the connection, forward nothing
                while await reader.read(65536):
                    pass
                return
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
            self._writers.add(upstream_writer)
            await asyncio.gather(self._pipe(reader, upstream_writer),
                                 self._pipe(upstream_reader, writer))
        except OSError:
            pass
        finally:
            for w in (writer, upstream_writer):
                if w is not None:
                    self._writers.discard(w)
                    w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if not self.cut:
                    writer.write(data)
                    await writer.drain()
        writer.close()
