"""Messages as producers build them, and the unique key each one carries."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..log.delay import DELAYED, PROP_TIMER_DELIVER_MS
from ..log.record import MessageExt, encode_part

__all__ = ["Message", "MessageExt", "SendResult", "UniqueKeyGenerator"]


@dataclass(slots=True)
class Message:
    """A message to send. ``keys`` are business keys (space separated); ``unique_key`` is
    assigned by the producer unless set. ``deliver_at_ms`` (ms since the epoch; 0: at once)
    makes it a delayed message: stored at once, delivered to its queue at that time
    (RocketMQ's delivery timestamp; ``Producer.send(..., delay_s=...)`` sets it; sent
    alone, not in a batch; docs/delayed.md)."""

    body: bytes
    tags: str = ""
    keys: str = ""
    properties: Mapping[str, str] = field(default_factory=dict)
    unique_key: str = ""
    deliver_at_ms: int = 0


@dataclass(slots=True)
class SendResult:
    topic: str
    queue_id: int
    offset: int  # -1 for a delayed message: its offset is known once it is delivered
    unique_key: str
    duplicate: bool = False  # the broker had already stored this message (producer retry)


def as_message(m: Message | bytes | str) -> Message:
    """What ``send`` takes, as a ``Message``: bytes and str become its body."""
    if isinstance(m, Message):
        return m
    if isinstance(m, str):
        return Message(m.encode())
    if isinstance(m, bytes | bytearray | memoryview):
        return Message(bytes(m))
    raise TypeError(f"cannot send {type(m).__name__}: use bytes, str or onceq.Message")


def _local_ip() -> bytes:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent for a UDP connect
            return socket.inet_aton(s.getsockname()[0])
    except OSError:
        return b"\x7f\x00\x00\x01"


class UniqueKeyGenerator:
    """Unique keys as hex: IP (4 bytes), PID (4), random (2), time ms (6), counter (4).

    The prefix is fixed per generator; time and counter make keys unique inside a process.
    """

    def __init__(self) -> None:
        prefix = _local_ip() + struct.pack(">I", os.getpid() & 0xFFFFFFFF) + os.urandom(2)
        self._prefix = prefix.hex().upper()
        self._next = 0  # the counter of the next key
        self._lock = threading.Lock()  # a producer may be shared by threads

    def next(self) -> str:
        return self.many(1)[0]

    def many(self, n: int) -> list[str]:
        """``n`` keys sharing one time stamp (cheaper than ``n`` calls of ``next``)."""
        head = f"{self._prefix}{int(time.time() * 1000) & 0xFFFFFFFFFFFF:012X}"
        with self._lock:
            first = self._next
            self._next = first + n
        first &= 0xFFFFFFFF
        if first + n <= 0x100000000:  # the counters formatted in one call
            return [head + c for c in ("%08X " * n % tuple(range(first, first + n))).split()]
        return [f"{head}{(first + i) & 0xFFFFFFFF:08X}" for i in range(n)]


def encode_message(msg: Message, unique_key: str, now_ms: int) -> bytes:
    if msg.deliver_at_ms:  # a delayed message: the flag and its time (log/delay.py)
        props = {**msg.properties, PROP_TIMER_DELIVER_MS: str(int(msg.deliver_at_ms))}
        return encode_part(msg.body, unique_key, now_ms, msg.tags, msg.keys, props, DELAYED)
    return encode_part(msg.body, unique_key, now_ms, msg.tags, msg.keys, msg.properties)
