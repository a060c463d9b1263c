"""Blocking wrappers: run the async clients on a private event loop in a thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from .message import Message, SendResult
from .producer import Producer
from .pull import PullConsumer, PullResult

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

    def fetch_offset(self, topic: str, queue: int) -> int:
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
