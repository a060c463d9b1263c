"""The listener runner: how a push consumer calls its listener, and reads its answer.

An async listener runs on the event loop; a plain one on the consumer's ``concurrency``
threads (:class:`ListenerThreads`). Whatever the listener returns is read once, by
:meth:`~onceq.client.consume.ConsumeResult.of`; an exception, a bad answer or a call over
the consume timeout is a failure (``ConsumeResult.retry()``: the batch is retried).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from ..log.record import MessageExt
from .consume import ConsumeContext, ConsumeResult, Listener

log = logging.getLogger("onceq.consumer")

FAILED = ConsumeResult.retry()


class ListenerThreads:
    """``n`` threads running the calls of a plain (not async) listener.

    Finished calls come back to the event loop in bulk: the first result of a burst
    schedules one wake-up of the loop, which settles every call finished by then (an
    executor wakes the loop once per call, the main cost at listener batch 1). Daemon
    threads: a consumer never shut down does not keep the process alive.
    """

    def __init__(self, n: int, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue[tuple[asyncio.Future[Any], Callable[..., Any],
                                            tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._done: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"onceq-consume-{i}",
                                          daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Run ``fn(*args)`` on a thread; its result or exception, on the loop."""
        fut = self._loop.create_future()
        self._jobs.put((fut, fn, args))
        return fut

    def shutdown(self) -> None:
        """Calls not started fail; running ones finish (their results are dropped)."""
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn, args = job
            result = exc = None
            if self._closed:
                exc = RuntimeError("the consumer was shut down")
            else:
                try:
                    result = fn(*args)
                except BaseException as e:  # handed to the caller, like an executor
                    exc = e
            with self._lock:
                self._done.append((fut, result, exc))
                first = len(self._done) == 1
            if first:
                # a closed loop: nobody waits any more
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._settle)

    def _settle(self) -> None:
        with self._lock:
            done, self._done = self._done, []
        for fut, result, exc in done:
            if fut.done():  # given up (the consume timeout)
                continue
            if exc is None:
                fut.set_result(result)
            else:
                fut.set_exception(exc)


def is_plain(listener: Any) -> bool:
    """Whether ``listener`` is a plain (not async) callable: it runs on a thread."""
    return not (inspect.iscoroutinefunction(listener)
                or inspect.iscoroutinefunction(type(listener).__call__))


class ListenerRunner:
    """Calls one listener: on the loop, or on threads (``threads`` set for a plain one)."""

    def __init__(self, listener: Listener, timeout_s: float,
                 threads: ListenerThreads | None = None) -> None:
        self.listener = listener
        self.timeout_s = timeout_s
        self.threads = threads
        # a coroutine function's call is awaited as it is (no check of what it returned)
        self._coroutine = threads is None and inspect.iscoroutinefunction(listener)

    @classmethod
    def start(cls, listener: Listener, concurrency: int, timeout_s: float) -> ListenerRunner:
        """A runner for ``listener``, with threads when it is a plain one (in a loop)."""
        threads = (ListenerThreads(concurrency, asyncio.get_running_loop())
                   if is_plain(listener) else None)
        return cls(listener, timeout_s, threads)

    def shutdown(self) -> None:
        if self.threads is not None:
            self.threads.shutdown()

    async def run(self, batch: list[MessageExt], ctx: ConsumeContext) -> ConsumeResult:
        """Call the listener without a timeout; an exception or a bad answer is a
        failure."""
        try:
            if self._coroutine:
                returned = await self.listener(batch, ctx)  # type: ignore[misc]
            elif self.threads is None:
                returned = self.listener(batch, ctx)
                if returned is not None and inspect.isawaitable(returned):
                    returned = await returned
            else:
                returned = await self.threads.submit(self.listener, batch, ctx)
            return ConsumeResult.of(returned, ctx, len(batch))
        except Exception:
            return self.failed(ctx)

    async def run_bounded(self, batch: list[MessageExt], ctx: ConsumeContext
                          ) -> ConsumeResult:
        """Call the listener under the consume timeout. A plain listener's call over time
        is waited for before this returns (a thread cannot be stopped, and one queue never
        has two calls at once); its answer is dropped."""
        if self.threads is None:
            try:
                async with asyncio.timeout(self.timeout_s):
                    return await self.run(batch, ctx)
            except TimeoutError:
                return self.timed_out(ctx)
        fut = self.threads.submit(self.listener, batch, ctx)
        done, _ = await asyncio.wait([fut], timeout=self.timeout_s)
        if not done:
            result = self.timed_out(ctx)
            await asyncio.wait([fut])
            return result
        try:
            return await answer(fut.result(), ctx, len(batch))
        except Exception:
            return self.failed(ctx)

    @staticmethod
    def failed(ctx: ConsumeContext) -> ConsumeResult:
        """In an ``except`` block: the listener raised, or answered with something that is
        no answer (it must not leave the batch in flight for ever, holding the queue's
        commit offset back)."""
        log.exception("listener failed on %s; retrying the batch", ctx.queue)
        return FAILED

    def timed_out(self, ctx: ConsumeContext) -> ConsumeResult:
        log.warning("listener exceeded the consume timeout of %.0fs on %s; retrying",
                    self.timeout_s, ctx.queue)
        return FAILED


async def answer(returned: Any, ctx: ConsumeContext, size: int) -> ConsumeResult:
    """The result a listener's return value stands for (awaited first when it is
    awaitable, e.g. from an object with an async ``__call__``)."""
    if returned is not None and inspect.isawaitable(returned):
        returned = await returned
    return ConsumeResult.of(returned, ctx, size)
