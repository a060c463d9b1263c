"""Broker-side dedup window for producer retries, keyed on (topic, unique key).

A retried send whose unique key was stored within the window gets the first send's result
back, flagged as a duplicate, and stores nothing. The window is rebuilt from the commit log
at start (records carry their unique key and store time), so it survives restarts. Memory is
bounded by ``max_keys``: above it the oldest keys are forgotten first.
"""

from __future__ import annotations

from collections import deque


class DedupWindow:
    __slots__ = ("_keys", "_order", "max_keys", "window_ms")

    def __init__(self, window_s: float, max_keys: int) -> None:
        self.window_ms = int(window_s * 1000)
        self.max_keys = max_keys
        self._keys: dict[tuple[str, bytes], tuple[int, int]] = {}  # -> (queue_id, offset)
        self._order: deque[tuple[int, tuple[str, bytes]]] = deque()

    @property
    def enabled(self) -> bool:
        return self.window_ms > 0 and self.max_keys > 0

    def __len__(self) -> int:
        return len(self._keys)

    def get(self, topic: str, key: bytes) -> tuple[int, int] | None:
        return self._keys.get((topic, key))

    def add(self, topic: str, key: bytes, queue_id: int, offset: int, ts_ms: int) -> None:
        k = (topic, key)
        self._keys[k] = (queue_id, offset)
        self._order.append((ts_ms, k))

    def expire(self, now_ms: int) -> None:
        order = self._order
        keys = self._keys
        limit = now_ms - self.window_ms
        while order and (order[0][0] < limit or len(order) > self.max_keys):
            _, k = order.popleft()
            keys.pop(k, None)

    def drop_topic(self, topic: str) -> None:
        for k in [k for k in self._keys if k[0] == topic]:
            del self._keys[k]
