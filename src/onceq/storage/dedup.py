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
        # topic -> key -> (queue_id, offset, ts_ms of the copy the entry belongs to)
        self._keys: dict[str, dict[bytes, tuple[int, int, int]]] = {}
        self._order: deque[tuple[int, str, bytes]] = deque()

    @property
    def enabled(self) -> bool:
        return self.window_ms > 0 and self.max_keys > 0

    def __len__(self) -> int:
        return sum(len(t) for t in self._keys.values())

    def table(self, topic: str) -> dict[bytes, tuple[int, int, int]]:
        """The live key table of one topic (key -> (queue_id, offset, ts_ms)); read only."""
        return self._keys.get(topic) or {}

    def add(self, topic: str, key: bytes, queue_id: int, offset: int, ts_ms: int) -> None:
        t = self._keys.get(topic)
        if t is None:
            t = self._keys[topic] = {}
        t[key] = (queue_id, offset, ts_ms)
        self._order.append((ts_ms, topic, key))

    def expire(self, now_ms: int) -> None:
        order = self._order
        keys = self._keys
        limit = now_ms - self.window_ms
        while order and (order[0][0] < limit or len(order) > self.max_keys):
            ts, topic, k = order.popleft()
            t = keys.get(topic)
            if t is None:
                continue
            v = t.get(k)
            if v is not None and v[2] == ts:  # not a newer copy of the same key
                del t[k]
                if not t:
                    del keys[topic]

    def drop_topic(self, topic: str) -> None:
        self._keys.pop(topic, None)
