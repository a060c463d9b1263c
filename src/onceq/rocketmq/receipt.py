"""Receipt handles: what a RocketMQ consumer sends back to acknowledge a received message
or change its invisible duration (pure: standard library only).

A handle names one delivery of one message: the consumer group, the topic, the queue, the
queue offset and the delivery's generation (each delivery of a message gets a new one, so
the handle of an earlier delivery is recognised as stale). It is signed with a key the
front end draws when it starts (HMAC-SHA256, 12 bytes): a handle changed in any byte, made
up by a client, or issued before the broker restarted is refused as a whole, never read as
another message's handle.

Layout before base64url (no padding)::

    u8  version (1)
    u32 queue
    u64 offset
    u64 generation
    u16 topic length, topic (utf-8)
    u16 group length, group (utf-8)
    12  MAC over everything before it
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import struct
from dataclasses import dataclass

VERSION = 1
MAC_SIZE = 12
_HEAD = struct.Struct(">BIQQ")
_LEN = struct.Struct(">H")
MAX_NAME = 1024  # bytes of a topic or group name in a handle


class BadReceipt(ValueError):
    """A receipt handle that does not decode or whose signature does not match."""


@dataclass(frozen=True, slots=True)
class Receipt:
    group: str
    topic: str
    queue: int
    offset: int
    generation: int


class ReceiptCodec:
    """Encodes and checks receipt handles with one key (the front end's, for its run)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("the receipt key must be at least 16 bytes")
        self._key = key

    def _mac(self, data: bytes) -> bytes:
        return hmac.new(self._key, data, hashlib.sha256).digest()[:MAC_SIZE]

    def encode(self, r: Receipt) -> str:
        topic, group = r.topic.encode(), r.group.encode()
        if len(topic) > MAX_NAME or len(group) > MAX_NAME:
            raise ValueError("topic or group name too long for a receipt handle")
        data = b"".join((_HEAD.pack(VERSION, r.queue, r.offset, r.generation),
                         _LEN.pack(len(topic)), topic, _LEN.pack(len(group)), group))
        return base64.urlsafe_b64encode(data + self._mac(data)).rstrip(b"=").decode()

    def decode(self, text: str) -> Receipt:
        """The receipt of ``text``; ``BadReceipt`` when it is not one this codec signed."""
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            raise BadReceipt("the receipt handle is not base64url") from None
        if len(raw) < _HEAD.size + 2 * _LEN.size + MAC_SIZE:
            raise BadReceipt("the receipt handle is too short")
        data, mac = raw[:-MAC_SIZE], raw[-MAC_SIZE:]
        if not hmac.compare_digest(mac, self._mac(data)):
            raise BadReceipt("the receipt handle was not issued by this broker since it "
                             "started (changed, made up, or from before a restart)")
        version, queue, offset, generation = _HEAD.unpack_from(data)
        if version != VERSION:
            raise BadReceipt(f"receipt handle version {version} is not known")
        pos = _HEAD.size
        names = []
        for _ in range(2):
            (n,) = _LEN.unpack_from(data, pos)
            pos += _LEN.size
            if pos + n > len(data):
                raise BadReceipt("the receipt handle is truncated")
            names.append(data[pos:pos + n].decode("utf-8", "replace"))
            pos += n
        if pos != len(data):
            raise BadReceipt("the receipt handle has trailing bytes")
        return Receipt(names[1], names[0], queue, offset, generation)
