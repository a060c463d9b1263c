"""How RocketMQ 5's messages, routes, filters and status codes map onto onceq's (pure:
no sockets, no broker; the ``apache.rocketmq.v2`` message classes of ``_pb``).

* A RocketMQ message is stored as one onceq message part: its message id is the unique
  key (so the broker's dedup window answers a retried send with the first one's offset),
  the tag is the tags, the keys are the keys (space separated, as RocketMQ's own
  ``KEYS`` property), the user properties are the properties, the born timestamp the
  born time. The body is stored as sent (a GZIP body is inflated first).
* A stored message goes back with its unique key as message id, the same tag, keys and
  properties, its queue and queue offset, store time, a receipt handle and a CRC32 body
  digest (8 upper-case hex digits, as the clients check it).
* FIFO messages: a message with a message group is stored in the queue its group hashes
  to, ``crc32(group) % queues`` as onceq's own producers place a ``sharding_key``
  (``queue_of``), so onceq's orderly consumers and RocketMQ's FIFO consumers see one
  order; the group is kept in the ``__SHARDINGKEY`` property (RocketMQ's own name for it)
  and given back as the message group of a FIFO message.
* Delayed messages (type ``DELAY``, ``delivery_timestamp``) are onceq's delayed messages:
  the part carries the ``DELAYED`` flag and the time in ``TIMER_DELIVER_MS``
  (``log/delay.py``), stored at once and delivered to their queue at that time; a consumer
  gets them back as ``DELAY`` messages with their delivery timestamp.
* Errors: onceq's stable codes become RocketMQ's status codes (``status_of``).
"""

from __future__ import annotations

import gzip
import time
import zlib
from collections.abc import Iterable

from ..log.delay import DELAYED, PROP_TIMER_DELIVER_MS, DelayError, check_delay
from ..log.message import MessageExt
from ..log.record import encode_part
from ..protocol.errors import ErrorCode, OnceqError
from ._pb import definition_pb2 as pb

Code = pb.Code
MAX_UNIQUE_KEY = 255  # bytes: onceq's unique key (ASCII)
PROP_MESSAGE_GROUP = "__SHARDINGKEY"  # a FIFO message's group (RocketMQ's property name)
MAX_MESSAGE_GROUP = 128  # characters (RocketMQ's limit)


class RmqError(Exception):
    """A request refused with a RocketMQ status code and a message for the user."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status(code: int = Code.OK, message: str = "OK") -> pb.Status:
    return pb.Status(code=code, message=message)  # type: ignore[arg-type]


_CODES: dict[ErrorCode, int] = {
    ErrorCode.BAD_REQUEST: Code.BAD_REQUEST,
    ErrorCode.INVALID_ARGUMENT: Code.BAD_REQUEST,
    ErrorCode.INVALID_QUEUE: Code.BAD_REQUEST,
    ErrorCode.INVALID_NAME: Code.BAD_REQUEST,
    ErrorCode.UNKNOWN_REQUEST: Code.NOT_IMPLEMENTED,
    ErrorCode.TOPIC_NOT_EXIST: Code.TOPIC_NOT_FOUND,
    ErrorCode.GROUP_NOT_EXIST: Code.CONSUMER_GROUP_NOT_FOUND,
    ErrorCode.MESSAGE_TOO_LARGE: Code.MESSAGE_BODY_TOO_LARGE,
    ErrorCode.FRAME_TOO_LARGE: Code.PAYLOAD_TOO_LARGE,
    ErrorCode.MESSAGE_NOT_FOUND: Code.MESSAGE_NOT_FOUND,
    ErrorCode.SYSTEM_BUSY: Code.TOO_MANY_REQUESTS,
    ErrorCode.TOO_MANY_CONNECTIONS: Code.TOO_MANY_REQUESTS,
    ErrorCode.TOO_MANY_GROUPS: Code.TOO_MANY_REQUESTS,
    ErrorCode.FLUSH_TIMEOUT: Code.MASTER_PERSISTENCE_TIMEOUT,
    ErrorCode.NOT_ENOUGH_REPLICAS: Code.HA_NOT_AVAILABLE,
    ErrorCode.UNAUTHENTICATED: Code.UNAUTHORIZED,
    ErrorCode.AUTH_FAILED: Code.UNAUTHORIZED,
    ErrorCode.ACCESS_DENIED: Code.FORBIDDEN,
    ErrorCode.SYSTEM_ERROR: Code.INTERNAL_SERVER_ERROR,
}


def status_of(exc: OnceqError) -> tuple[int, str]:
    """RocketMQ's code for an onceq error, and its message (onceq's code name first, so
    the user can look it up). Retriable errors (disk full, storage, shutting down, not the
    leader) are INTERNAL_ERROR, which the official producers retry."""
    code = _CODES.get(exc.code, Code.INTERNAL_ERROR)
    return code, f"{exc.code.name}: {exc.message}"


# ------------------------------------------------------------------ sends
def check_message_id(message_id: str) -> str:
    if not message_id or not message_id.isascii() or len(message_id) > MAX_UNIQUE_KEY:
        raise RmqError(Code.ILLEGAL_MESSAGE_ID, f"message id {message_id!r} must be 1-"
                       f"{MAX_UNIQUE_KEY} ASCII characters (it is onceq's unique key)")
    return message_id


def message_group(msg: pb.Message) -> str | None:
    """The message group of a message to send (None: not a FIFO message); refuses the
    message types onceq does not store."""
    sp = msg.system_properties
    mtype = sp.message_type
    group = sp.message_group if sp.HasField("message_group") else ""
    if mtype not in (pb.MESSAGE_TYPE_UNSPECIFIED, pb.NORMAL, pb.FIFO, pb.DELAY):
        name = pb.MessageType.Name(mtype)
        raise RmqError(Code.UNSUPPORTED, f"message type {name}: onceq's RocketMQ endpoint "
                       "stores NORMAL, FIFO and DELAY messages only (not built)")
    if delivery_ms(msg) is not None and (mtype == pb.FIFO or group):
        raise RmqError(Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE, "a delayed message "
                       "(delivery_timestamp) has no message group")
    if mtype == pb.FIFO and not group:
        raise RmqError(Code.ILLEGAL_MESSAGE_GROUP, "a FIFO message needs a message group")
    if not group:
        return None
    if len(group) > MAX_MESSAGE_GROUP or not group.strip() or not group.isprintable():
        raise RmqError(Code.ILLEGAL_MESSAGE_GROUP, f"message group {group[:40]!r} must be "
                       f"1-{MAX_MESSAGE_GROUP} printable characters, not only blanks")
    return group


def delivery_ms(msg: pb.Message) -> int | None:
    """The delivery time in ms of a delayed message (None: not one); a DELAY message
    without a delivery timestamp is refused."""
    sp = msg.system_properties
    ts = sp.delivery_timestamp if sp.HasField("delivery_timestamp") else None
    if ts is None or not (ts.seconds or ts.nanos):
        if sp.message_type == pb.DELAY:
            raise RmqError(Code.ILLEGAL_DELIVERY_TIME, "a DELAY message needs a "
                           "delivery_timestamp")
        return None
    ms = ts.seconds * 1000 + ts.nanos // 1_000_000
    if ms < 0:
        raise RmqError(Code.ILLEGAL_DELIVERY_TIME, f"delivery_timestamp {ms} ms is before "
                       "the epoch")
    return ms


def queue_of(group: str, queues: int) -> int:
    """The queue of a message group: as onceq's producers place a ``sharding_key``."""
    return zlib.crc32(group.encode()) % queues


def to_part(msg: pb.Message, now_ms: int | None = None) -> bytes:
    """One RocketMQ message as the onceq message part the send path stores."""
    return to_send(msg, int(time.time() * 1000) if now_ms is None else now_ms)[0]


def to_send(msg: pb.Message, now_ms: int, max_delay_s: float | None = None
            ) -> tuple[bytes, str | None]:
    """One RocketMQ message as the onceq message part the send path stores, and its
    message group (None: not a FIFO message); with ``max_delay_s``, a delivery time
    further ahead is refused as RocketMQ does (``ILLEGAL_DELIVERY_TIME``)."""
    sp = msg.system_properties
    group = message_group(msg)
    deliver = delivery_ms(msg)
    if deliver is not None and max_delay_s is not None:
        try:
            check_delay(deliver, now_ms, max_delay_s)
        except DelayError as exc:
            raise RmqError(Code.ILLEGAL_DELIVERY_TIME, str(exc)) from None
    unique_key = check_message_id(sp.message_id)
    body = msg.body
    if sp.body_encoding == pb.GZIP:
        try:
            body = gzip.decompress(body)
        except (OSError, EOFError, zlib.error):
            raise RmqError(Code.MESSAGE_CORRUPTED, "the GZIP body does not inflate") from None
    keys = list(sp.keys)
    for k in keys:
        if not k or any(c.isspace() for c in k):
            raise RmqError(Code.ILLEGAL_MESSAGE_KEY, f"message key {k!r}: keys are stored "
                           "space separated, so a key must be non-empty without blanks")
    born = sp.born_timestamp
    born_ms = born.seconds * 1000 + born.nanos // 1_000_000
    if born_ms <= 0:
        born_ms = now_ms
    props = dict(msg.user_properties)
    props.pop(PROP_MESSAGE_GROUP, None)  # the message group alone sets it
    props.pop(PROP_TIMER_DELIVER_MS, None)  # the delivery timestamp alone sets it
    if group is not None:
        props[PROP_MESSAGE_GROUP] = group
    if deliver is not None:
        props[PROP_TIMER_DELIVER_MS] = str(deliver)
    part = encode_part(bytes(body), unique_key, born_ms, sp.tag if sp.HasField("tag") else "",
                       " ".join(keys), props or None, 0 if deliver is None else DELAYED)
    return part, group


# ------------------------------------------------------------------ deliveries
def crc32_hex(body: bytes) -> str:
    return f"{zlib.crc32(body) & 0xFFFFFFFF:08X}"


def to_pb(m: MessageExt, *, namespace: str, receipt: str, invisible_s: float, attempt: int,
          store_host: str) -> pb.Message:
    """A stored message as a RocketMQ consumer receives it."""
    out = pb.Message()
    out.topic.name = m.topic
    out.topic.resource_namespace = namespace
    group = None
    deliver = None
    for k, v in m.properties.items():
        if k == PROP_MESSAGE_GROUP:
            group = v if isinstance(v, str) else str(v)
            continue
        if k == PROP_TIMER_DELIVER_MS and isinstance(v, str) and v.isdigit():
            deliver = int(v)  # a delayed message: its delivery timestamp
            continue
        out.user_properties[str(k)] = v if isinstance(v, str) else str(v)
    body = bytes(m.body)
    out.body = body
    sp = out.system_properties
    if m.tags:
        sp.tag = m.tags
    sp.keys.extend(m.key_list)
    sp.message_id = m.unique_key
    sp.body_digest.type = pb.CRC32
    sp.body_digest.checksum = crc32_hex(body)
    sp.body_encoding = pb.IDENTITY
    sp.message_type = pb.NORMAL
    if group:
        sp.message_type = pb.FIFO
        sp.message_group = group
    elif deliver is not None:
        sp.message_type = pb.DELAY
        sp.delivery_timestamp.FromMilliseconds(deliver)
    sp.born_timestamp.FromMilliseconds(m.born_ts_ms)
    sp.store_timestamp.FromMilliseconds(m.store_ts_ms)
    sp.store_host = store_host
    sp.receipt_handle = receipt
    sp.queue_id = m.queue_id
    sp.queue_offset = m.queue_offset
    sp.invisible_duration.FromMilliseconds(int(invisible_s * 1000))
    sp.delivery_attempt = attempt
    return out


def parse_filter(expr: pb.FilterExpression | None) -> list[str] | None:
    """The tags a subscription's filter expression accepts (None: every message).
    ``*`` or empty is every message; ``a || b`` is tag a or tag b; SQL92 is refused."""
    if expr is None:
        return None
    if expr.type == pb.SQL:
        raise RmqError(Code.ILLEGAL_FILTER_EXPRESSION, "SQL92 filters are not supported by "
                       "onceq: filter by tag (TAG type, 'a || b')")
    text = expr.expression.strip()
    if not text or text == "*":
        return None
    tags = [t.strip() for t in text.split("||")]
    if not all(tags):
        raise RmqError(Code.ILLEGAL_FILTER_EXPRESSION, f"tag expression {text!r} has an "
                       "empty tag")
    return tags


# ------------------------------------------------------------------ routes
def endpoints(host: str, port: int) -> pb.Endpoints:
    e = pb.Endpoints()
    e.scheme = pb.IPv6 if ":" in host else (
        pb.IPv4 if host.replace(".", "").isdigit() else pb.DOMAIN_NAME)
    e.addresses.add(host=host, port=port)
    return e


def route(topic: str, queues: int, *, namespace: str, broker: str, where: pb.Endpoints
          ) -> Iterable[pb.MessageQueue]:
    """The topic's queues as RocketMQ message queues: one broker (id 0, the leader),
    readable and writable, accepting NORMAL, FIFO and DELAY messages."""
    for qid in range(queues):
        mq = pb.MessageQueue()
        mq.topic.name = topic
        mq.topic.resource_namespace = namespace
        mq.id = qid
        mq.permission = pb.READ_WRITE
        mq.broker.name = broker
        mq.broker.id = 0
        mq.broker.endpoints.CopyFrom(where)
        mq.accept_message_types.extend((pb.NORMAL, pb.FIFO, pb.DELAY))
        yield mq
