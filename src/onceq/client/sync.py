"""Blocking wrappers: run the async clients on a private event loop in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from .allocation import MessageQueue
from .message import Message, SendResult
from .producer import Producer
from .pull import PullConsumer, PullResult
from .push import Listener, PushConsumer
from .push_config import PushConsumerConfig
from .request_reply import Reply

T = TypeVar("T")


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="onceq-client")
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError("the client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

    def start(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run the client's start; on failure stop the thread (no thread left behind)."""
        try:
            self.run(coro)
        except BaseException:
            self.stop()
            raise

    def close(self, coro: Coroutine[Any, Any, Any]) -> None:
        if self.loop.is_closed():
            coro.close()
            return
        try:
            self.run(coro)
        finally:
            self.stop()


class SyncProducer:
    """``Producer`` with blocking calls, for code that is not async."""

    def __init__(self, address: str = "127.0.0.1:9876", **kwargs: Any) -> None:
        self._lt = _LoopThread()
        self._p = Producer(address, **kwargs)
        self._lt.start(self._p.start())

    def send(self, topic: str, message: Message | bytes | str, **kw: Any) -> SendResult:
        return self._lt.run(self._p.send(topic, message, **kw))

    def send_batch(self, topic: str, messages: Sequence[Message | bytes | str], **kw: Any
                   ) -> list[SendResult]:
        return self._lt.run(self._p.send_batch(topic, messages, **kw))

    def send_oneway(self, topic: str, message: Message | bytes | str, **kw: Any) -> None:
        self._lt.run(self._p.send_oneway(topic, message, **kw))

    def request(self, topic: str, message: Message | bytes | str, timeout: float = 3.0,
                **kw: Any) -> Reply:
        """``Producer.request``: send a request, block until its reply (or
        ``RequestTimeout``)."""
        return self._lt.run(self._p.request(topic, message, timeout, **kw))

    @property
    def request_stats(self) -> dict[str, Any]:
        """The request-reply counters and round-trip percentiles."""
        return self._lt.run(self._request_stats())

    async def _request_stats(self) -> dict[str, Any]:
        return self._p.requests.stats

    def close(self) -> None:
        self._lt.close(self._p.close())

    def __enter__(self) -> SyncProducer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SyncPullConsumer:
    """``PullConsumer`` with blocking calls."""

    def __init__(self, address: str = "127.0.0.1:9876", group: str = "DEFAULT_GROUP",
                 **kwargs: Any) -> None:
        self._lt = _LoopThread()
        self._c = PullConsumer(address, group, **kwargs)
        self._lt.start(self._c.start())

    def pull(self, topic: str, queue: int, offset: int, max_msgs: int = 32, **kw: Any
             ) -> PullResult:
        return self._lt.run(self._c.pull(topic, queue, offset, max_msgs, **kw))

    def commit_offset(self, topic: str, queue: int, offset: int) -> None:
        self._lt.run(self._c.commit_offset(topic, queue, offset))

    def fetch_offset(self, topic: str, queue: int) -> int | None:
        return self._lt.run(self._c.fetch_offset(topic, queue))

    def queue_offsets(self, topic: str, queue: int) -> tuple[int, int]:
        return self._lt.run(self._c.queue_offsets(topic, queue))

    def search_offset(self, topic: str, queue: int, timestamp_ms: int) -> int:
        return self._lt.run(self._c.search_offset(topic, queue, timestamp_ms))

    def queue_count(self, topic: str) -> int:
        return self._lt.run(self._c.queue_count(topic))

    def close(self) -> None:
        self._lt.close(self._c.close())

    def __enter__(self) -> SyncPullConsumer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SyncPushConsumer:
    """``PushConsumer`` for code that is not async: ``start()`` and ``shutdown()`` block;
    the consumer runs on a private event loop in a thread.

    The listener is a plain function ``(msgs, ctx) -> None | ConsumeStatus``; it runs in
    the consumer's thread pool (up to ``concurrency`` calls at once), so it must be
    thread-safe. Settings are ``PushConsumerConfig`` fields, as keywords or ``config``::

        def handle(msgs, ctx):
            for m in msgs:
                print(m.body)

        with SyncPushConsumer("127.0.0.1:9876", "orders-group", handle,
                              subscriptions={"orders": "*"}):
            time.sleep(60)

    ``subscriptions`` maps topic -> tag expression (or is a list of topics, all tags);
    ``subscribe()`` adds more. Do not call ``shutdown()`` from the listener: it waits for
    running listener calls (up to the drain timeout).
    """

    def __init__(self, address: str, group: str, listener: Listener | None = None,
                 config: PushConsumerConfig | None = None, *,
                 subscriptions: Mapping[str, str] | Iterable[str] | None = None,
                 client_id: str | None = None, **overrides: Any) -> None:
        self._c = PushConsumer(address, group, listener, config, client_id=client_id,
                               **overrides)
        if isinstance(subscriptions, Mapping):
            for topic, expression in subscriptions.items():
                self._c.subscribe(topic, expression)
        elif subscriptions is not None:
            for topic in subscriptions:
                self._c.subscribe(topic)
        self._lt: _LoopThread | None = None
        self._lock = threading.Lock()

    @property
    def group(self) -> str:
        return self._c.group

    @property
    def client_id(self) -> str:
        return self._c.client_id

    @property
    def config(self) -> PushConsumerConfig:
        return self._c.config

    @property
    def idempotent_listener(self) -> Any:
        """The idempotency guard (``idempotency=`` option) once started: its ``stats``."""
        return self._c.idempotent_listener

    @property
    def running(self) -> bool:
        return self._lt is not None

    def subscribe(self, topic: str, expression: str = "*") -> None:
        """Consume ``topic`` (before or after ``start()``)."""
        if self._lt is None:
            self._c.subscribe(topic, expression)
        else:
            self._lt.run(self._subscribe(topic, expression))

    async def _subscribe(self, topic: str, expression: str) -> None:
        self._c.subscribe(topic, expression)

    def register_listener(self, listener: Listener) -> None:
        self._c.register_listener(listener)

    def start(self) -> SyncPushConsumer:
        """Connect, join the group and start consuming; return once started."""
        with self._lock:
            if self._lt is not None:
                raise RuntimeError("the consumer is already started")
            lt = _LoopThread()
            try:
                lt.run(self._c.start())
            except BaseException:
                with contextlib.suppress(Exception):  # undo a half start (its connection)
                    lt.close(self._c.shutdown())
                lt.stop()
                raise
            self._lt = lt
        return self

    def shutdown(self) -> None:
        """Stop pulling, let running listener calls finish (up to the drain timeout),
        commit offsets and leave the group; return when done. Idempotent."""
        with self._lock:
            lt, self._lt = self._lt, None
            if lt is not None:
                lt.close(self._c.shutdown())

    close = shutdown

    @property
    def assignment(self) -> list[MessageQueue]:
        """Queues this member owns now."""
        lt = self._lt
        return self._c.assignment if lt is None else lt.run(self._assignment())

    async def _assignment(self) -> list[MessageQueue]:
        return self._c.assignment

    @property
    def stats(self) -> Counter[str]:
        """Counters: consumed, failed, sent_back, ... (a copy)."""
        lt = self._lt
        return Counter(self._c.stats) if lt is None else lt.run(self._stats())

    async def _stats(self) -> Counter[str]:
        return Counter(self._c.stats)

    def __enter__(self) -> SyncPushConsumer:
        if self._lt is None:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

