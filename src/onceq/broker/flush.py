"""Flush service: background fsync (``async``) or group commit (``sync``).

``async``: every ``interval`` the dirty commit-log segments are fsynced off the event loop;
a send is acknowledged once its bytes are in the page cache (like Redis/NATS defaults).

``sync``: a send is acknowledged only after an fsync that covers its bytes. Sends that
arrive while an fsync is running wait for the next one, so concurrent sends share one fsync
(group commit).

A failed fsync is never retried: after it the state of the written pages is unknown (Linux
may mark them clean and report the next fsync as a success). The store stops accepting
writes until a restart (``WriteGate.fail_stop``); in ``sync`` mode the records after the
last successful fsync, none of them acknowledged, are removed from the log and the indexes
first, and the sends waiting for that fsync get ``STORAGE_ERROR``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from .._aio import wait_event
from ..protocol.errors import ErrorCode, OnceqError
from ..storage.commitlog import fsync_all
from ..storage.store import MessageStore

log = logging.getLogger("onceq.broker")


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
            store = self.store
            if store.write_failure is not None:  # nothing after ``flushed`` is durable
                self._fail(OnceqError(ErrorCode.STORAGE_ERROR, "not acknowledged: writes "
                                      f"are refused until a restart ({store.write_failure})"))
                return
            target = store.log.end
            fds = store.log.take_dirty()
            if fds:
                fut = asyncio.get_running_loop().run_in_executor(None, fsync_all,
                                                                 store.files, fds)
                self._inflight = fut
                log_ = store.log
                log_.syncing = True  # until the fsync ends, even if this task is cancelled
                fut.add_done_callback(lambda _f: setattr(log_, "syncing", False))
                try:
                    # shielded: a cancelled flush task must not look finished while its
                    # fsync still runs (``stop`` waits for it before the final flush)
                    await asyncio.shield(fut)
                except OSError as exc:
                    # Never acknowledge bytes whose fsync failed, and never fsync them
                    # again hoping for a success: stop writing (sync: remove the records
                    # that were waiting for this fsync first)
                    reason = f"fsync of the commit log failed: {exc}"
                    store.gate.fail_stop(reason, self.flushed if self.sync_policy else None)
                    self._fail(OnceqError(ErrorCode.STORAGE_ERROR, f"{reason}: not "
                                          "acknowledged; writes refused until a restart"))
                    raise
                self.fsyncs += 1  # fsync rounds that had something to sync
            store.log.release_retired()  # no fsync in flight now
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
            except OSError as exc:  # the store stopped writing (logged there)
                log.debug("flush failed: %s", exc)
                await asyncio.sleep(self.interval)
            except Exception:
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
        except OSError as exc:
            log.error("final flush failed: %s", exc)
        self._fail(OnceqError(ErrorCode.SHUTTING_DOWN, "broker stopped before the flush"))
