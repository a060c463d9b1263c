"""The stored message as a consumer sees it, eager or read lazily out of a record batch.

``MessageExt`` holds its fields. A pull's record batch decodes into ``BatchMessage``s that
share the batch's columns (``BatchColumns``) and keep only their index: a field is read out
of the batch when it is asked for (the body as a slice of the pulled bytes, the unique key
decoded then), so a consumer pays for the fields it reads. Only messages without tags, keys
or properties are read lazily: their unique keys were checked as ASCII for the whole batch
when it was decoded, and a body slice cannot fail, so reading a field never raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(slots=True)
class MessageExt:
    """A stored message as a consumer sees it (RocketMQ's name; ``onceq.Message`` is what a
    producer sends)."""

    topic: str
    queue_id: int
    queue_offset: int
    body: bytes
    unique_key: str
    tags: str = ""
    keys: str = ""
    properties: dict[str, Any] = field(default_factory=dict)
    born_ts_ms: int = 0
    store_ts_ms: int = 0
    reconsume_times: int = 0
    flags: int = 0
    position: int = -1

    @property
    def key_list(self) -> list[str]:
        return self.keys.split()


_FIELDS = tuple(f.name for f in fields(MessageExt))


def field_values(m: MessageExt) -> tuple[Any, ...]:
    """The message's fields in declaration order (``MessageExt(*field_values(m))`` is an
    eager copy of it)."""
    return tuple(getattr(m, name) for name in _FIELDS)


class BatchColumns:
    """What the messages of one pulled record batch share: the record's header fields, the
    batch (decompressed) and its columns (``batch.columns``)."""

    __slots__ = ("base", "born", "flags", "keys", "plain", "position", "queue_id", "recons",
                 "starts", "store_ts_ms", "topic")

    def __init__(self, topic: str, queue_id: int, base: int, store_ts_ms: int, position: int,
                 plain: bytes, born: tuple[int, ...], flags: tuple[int, ...],
                 recons: tuple[int, ...], keys: list[bytes], starts: list[int]) -> None:
        self.topic = topic
        self.queue_id = queue_id
        self.base = base
        self.store_ts_ms = store_ts_ms
        self.position = position
        self.plain = plain
        self.born = born
        self.flags = flags
        self.recons = recons
        self.keys = keys
        self.starts = starts


class BatchMessage(MessageExt):
    """Message ``i`` of a pulled record batch, with no tags, keys or properties, its fields
    read from the batch when asked for. Equal to the ``MessageExt`` of the same fields;
    pickles and copies as one."""

    __slots__ = ("_c", "_i", "_p")

    def __init__(self, columns: BatchColumns, i: int) -> None:
        self._c = columns
        self._i = i

    @property  # type: ignore[override]
    def topic(self) -> str:
        return self._c.topic

    @property  # type: ignore[override]
    def queue_id(self) -> int:
        return self._c.queue_id

    @property  # type: ignore[override]
    def queue_offset(self) -> int:
        return self._c.base + self._i

    @property  # type: ignore[override]
    def body(self) -> bytes:
        starts, i = self._c.starts, self._i
        return self._c.plain[starts[i]:starts[i + 1]]

    @property  # type: ignore[override]
    def unique_key(self) -> str:
        return self._c.keys[self._i].decode("ascii")

    @property  # type: ignore[override]
    def tags(self) -> str:
        return ""

    @property  # type: ignore[override]
    def keys(self) -> str:
        return ""

    @property  # type: ignore[override]
    def properties(self) -> dict[str, Any]:
        try:
            return self._p
        except AttributeError:  # the first read: one map, kept (a caller may fill it)
            p: dict[str, Any] = {}
            self._p = p
            return p

    @property  # type: ignore[override]
    def born_ts_ms(self) -> int:
        return self._c.born[self._i]

    @property  # type: ignore[override]
    def store_ts_ms(self) -> int:
        return self._c.store_ts_ms

    @property  # type: ignore[override]
    def reconsume_times(self) -> int:
        return self._c.recons[self._i]

    @property  # type: ignore[override]
    def flags(self) -> int:
        return self._c.flags[self._i]

    @property  # type: ignore[override]
    def position(self) -> int:
        return self._c.position

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MessageExt):
            return NotImplemented
        return field_values(self) == field_values(other)

    __hash__ = None  # type: ignore[assignment] - mutable, as MessageExt

    def __reduce__(self) -> tuple[type[MessageExt], tuple[Any, ...]]:
        return MessageExt, field_values(self)
