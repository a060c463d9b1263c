"""Flush service: background fsync (``async``) or group commit (``sync``).

``async``: every ``interval`` the dirty commit-log segments are fsynced off the event loop;
a send is acknowledged once its bytes are in the page cache (like Redis/NATS defaults).

``sync``: a send is acknowledged only after an fsync that covers its bytes. Sends that
arrive while an fsync is running wait for the next one, so concurrent sends share one fsync
(group commit).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import Callable

from .._aio import wait_event
from ..protocol.errors import ErrorCode, OnceqError
from ..storage.store import MessageStore

log = logging.getLogger("onceq.broker")


def _fsync_all(fds: list[int], fsync: Callable[[int], None]) -> None:
    for fd in fds:
        try:
            fsync(fd)
        except OSError as exc:
            if exc.errno != errno.EBADF:
                raise  # a real I/O error: the bytes are not known to be on disk
            log.debug("fsync skipped (segment deleted by retention meanwhile): %s", exc)


class Flusher:
    def __init__(self, store: MessageStore, policy: str, interval_ms: int) -> None:
        self.store = store
        self.sync_policy = policy == "sync"
        self.interval = interval_ms / 1000
        self.flushed = store.log.end  # everything before this position is durable
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # One flush at a time: a second flush must not mark as durable bytes whose fsync is
        # still running in the first one (it would find no dirty fds and return at once).
        self._lock = asyncio.Lock()
        self._inflight: asyncio.Future[None] | None = None
        self._retry_fds: set[int] = set()
        self.fsyncs = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="onceq-flush")

    def wait_durable(self, end: int) -> asyncio.Future[None]:
        """A future resolved once every byte before ``end`` is fsynced."""
        fut = asyncio.get_running_loop().create_future()
        if end <= self.flushed:
            fut.set_result(None)
        else:
            self._waiters.append((end, fut))
            self._wake.set()
        return fut

    async def flush_now(self) -> None:
        async with self._lock:
            target = self.store.log.end
            fds = self.store.log.take_dirty()
            if self._retry_fds:  # segments whose last fsync failed are synced again
                fds = list(set(fds) | self._retry_fds)
                self._retry_fds.clear()
            if fds:
                fut = asyncio.get_running_loop().run_in_executor(None, _fsync_all, fds,
                                                                 self.store.files.fsync)
                self._inflight = fut
                try:
                    # shielded: a cancelled flush task must not look finished while its
                    # fsync still runs (``stop`` waits for it before the final flush)
                    await asyncio.shield(fut)
                except OSError as exc:
                    self._retry_fds.update(fds)
                    # Never acknowledge bytes whose fsync failed: fail their waiters (the
                    # producer retries; the dedup window answers with the stored result).
                    self._fail(OnceqError(ErrorCode.FLUSH_TIMEOUT, f"fsync failed: {exc}"))
                    raise
                self.fsyncs += 1  # fsync rounds that had something to sync
            self.flushed = max(self.flushed, target)
            self._resolve()

    def _fail(self, err: OnceqError) -> None:
        waiters, self._waiters = self._waiters, []
        for _, fut in waiters:
            if not fut.done():
                fut.set_exception(err)

    def _resolve(self) -> None:
        if self._waiters:
            still = []
            for end, fut in self._waiters:
                if end <= self.flushed:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    still.append((end, fut))
            self._waiters = still

    async def _run(self) -> None:
        while True:
            try:
                if self.sync_policy:
                    await wait_event(self._wake, self.interval)
                    self._wake.clear()
                else:
                    await asyncio.sleep(self.interval)
                if self.store.log.end > self.flushed or self._waiters:
                    await self.flush_now()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep flushing; a failed fsync is retried next round
                log.exception("flush failed")
                await asyncio.sleep(self.interval)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._inflight is not None and not self._inflight.done():
            await asyncio.wait([self._inflight])
        try:
            await self.flush_now()
        except OSError:
            log.exception("final flush failed")
        self._fail(OnceqError(ErrorCode.SHUTTING_DOWN, "broker stopped before the flush"))
