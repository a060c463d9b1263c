"""Stable error codes of the onceq wire protocol.

Every response carries a numeric code. ``0`` is success; everything else is an error
with a stable number, a stable symbolic name and a human-readable message. Codes marked
retriable are the ones a producer retries (RocketMQ's "service unavailable", "system
busy", "topic missing on that broker" family).
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    OK = 0
    SYSTEM_ERROR = 1
    BAD_REQUEST = 2
    UNKNOWN_REQUEST = 3
    FRAME_TOO_LARGE = 4
    UNSUPPORTED_VERSION = 5
    TOPIC_NOT_EXIST = 10
    TOPIC_EXISTS = 11
    INVALID_NAME = 12
    INVALID_QUEUE = 13
    MESSAGE_TOO_LARGE = 14
    INVALID_ARGUMENT = 15
    GROUP_NOT_EXIST = 16
    NOT_HOLDER = 17
    GROUP_ACTIVE = 18
    OFFSET_BEHIND = 19  # a commit below the group's committed offset (only a reset goes back)
    MESSAGE_NOT_FOUND = 49
    SERVICE_UNAVAILABLE = 30
    SYSTEM_BUSY = 31
    FLUSH_TIMEOUT = 32
    SHUTTING_DOWN = 33
    DISK_FULL = 34
    STORAGE_ERROR = 35
    TOO_MANY_CONNECTIONS = 36
    NOT_LEADER = 37  # a broker group's follower: the answer names the leader when known
    NOT_ENOUGH_REPLICAS = 38  # fewer in-sync replicas than min_insync: not acknowledged
    STALE_EPOCH = 39  # a replica request made under another leader epoch than the current
    OUT_OF_ORDER_SEQUENCE = 40
    INVALID_SEQUENCE = 41
    NOT_MEMBER = 43  # an orderly lock request from a client that is no member of the group
    TOO_MANY_GROUPS = 44  # a heartbeat past the groups a client or the broker may have
    CLIENT_ID_IN_USE = 45  # a request naming a client id another connection owns
    WRITER_IN_USE = 46  # a sequenced send naming a writer id another connection or user owns
    UNAUTHENTICATED = 50  # a request before the connection authenticated (ACLs are on)
    AUTH_FAILED = 51  # wrong user or password, or too many failures from this source
    ACCESS_DENIED = 52  # the user has no grant for the request (or a deny)
    USER_NOT_EXIST = 53
    USER_EXISTS = 54
    REQUEST_TIMEOUT = 55  # request-reply: no reply within the request's timeout
    QUEUE_FULL = 56  # the queue's fuse: its slowest consumer group is too far behind
    WRONG_GROUP = 57  # the queue lives on another broker group (its route names it)
    QUEUE_MOVING = 58  # the queue is moving to another broker group: try again shortly


RETRIABLE: frozenset[ErrorCode] = frozenset(
    {
        ErrorCode.SERVICE_UNAVAILABLE,
        ErrorCode.SYSTEM_BUSY,
        ErrorCode.FLUSH_TIMEOUT,
        ErrorCode.SHUTTING_DOWN,
        ErrorCode.DISK_FULL,
        ErrorCode.STORAGE_ERROR,
        ErrorCode.TOO_MANY_CONNECTIONS,
        ErrorCode.NOT_LEADER,
        ErrorCode.NOT_ENOUGH_REPLICAS,
        ErrorCode.STALE_EPOCH,
        ErrorCode.CLIENT_ID_IN_USE,
        ErrorCode.WRITER_IN_USE,
        ErrorCode.QUEUE_FULL,
        ErrorCode.WRONG_GROUP,
        ErrorCode.QUEUE_MOVING,
    }
)

DEFAULT_MESSAGES: dict[ErrorCode, str] = {
    ErrorCode.OK: "ok",
    ErrorCode.SYSTEM_ERROR: "internal broker error",
    ErrorCode.BAD_REQUEST: "malformed request",
    ErrorCode.UNKNOWN_REQUEST: "unknown request code",
    ErrorCode.FRAME_TOO_LARGE: "frame exceeds the maximum frame size",
    ErrorCode.UNSUPPORTED_VERSION: "unsupported protocol version",
    ErrorCode.TOPIC_NOT_EXIST: "topic does not exist",
    ErrorCode.TOPIC_EXISTS: "topic already exists",
    ErrorCode.INVALID_NAME: "invalid name",
    ErrorCode.INVALID_QUEUE: "queue id out of range",
    ErrorCode.MESSAGE_TOO_LARGE: "message body exceeds the maximum body size",
    ErrorCode.INVALID_ARGUMENT: "invalid argument",
    ErrorCode.GROUP_NOT_EXIST: "consumer group does not exist",
    ErrorCode.NOT_HOLDER: "the client does not hold this queue's access lock",
    ErrorCode.GROUP_ACTIVE: "the consumer group has live members",
    ErrorCode.OFFSET_BEHIND: "the commit is below the group's committed offset: offsets "
                             "move back only by an explicit reset",
    ErrorCode.MESSAGE_NOT_FOUND: "no message with this key in the searched range",
    ErrorCode.SERVICE_UNAVAILABLE: "service unavailable",
    ErrorCode.SYSTEM_BUSY: "broker busy, try again",
    ErrorCode.FLUSH_TIMEOUT: "flush to disk timed out",
    ErrorCode.SHUTTING_DOWN: "broker is shutting down",
    ErrorCode.DISK_FULL: "disk full or above the usage limit: writes refused for now",
    ErrorCode.STORAGE_ERROR: "storage I/O error: the write was rolled back",
    ErrorCode.TOO_MANY_CONNECTIONS: "the broker is at its connection limit: try again later",
    ErrorCode.NOT_LEADER: "this broker does not lead its group: send to the leader",
    ErrorCode.NOT_ENOUGH_REPLICAS: "too few in-sync replicas to acknowledge the write: try "
                                   "again",
    ErrorCode.STALE_EPOCH: "the request was made under another leader epoch",
    ErrorCode.OUT_OF_ORDER_SEQUENCE: "a writer's sequence skips messages: send again from the "
                                     "first one not acknowledged",
    ErrorCode.INVALID_SEQUENCE: "malformed writer id, epoch or sequence",
    ErrorCode.NOT_MEMBER: "the client is not a member of the group: send a heartbeat first",
    ErrorCode.TOO_MANY_GROUPS: "too many consumer groups for this client or this broker",
    ErrorCode.CLIENT_ID_IN_USE: "the client id belongs to another connection",
    ErrorCode.WRITER_IN_USE: "the writer id belongs to another connection or user",
    ErrorCode.UNAUTHENTICATED: "authenticate first: the broker requires a user",
    ErrorCode.AUTH_FAILED: "authentication failed",
    ErrorCode.ACCESS_DENIED: "access denied",
    ErrorCode.USER_NOT_EXIST: "no such user",
    ErrorCode.USER_EXISTS: "the user already exists",
    ErrorCode.REQUEST_TIMEOUT: "no reply within the request's timeout: the request may "
                               "still be carried out",
    ErrorCode.QUEUE_FULL: "the queue's backlog is past its fuse: send to another queue, "
                          "or later",
    ErrorCode.WRONG_GROUP: "the queue lives on another broker group: fetch the topic's "
                           "route",
}


class OnceqError(Exception):
    """An error with a stable code. ``retriable`` tells whether repeating may succeed.
    ``details``: more header fields of the error answer (``NOT_LEADER``: ``leader``, the
    leader's address, and ``epoch``)."""

    def __init__(self, code: ErrorCode | int, message: str | None = None,
                 details: dict[str, object] | None = None) -> None:
        self.details: dict[str, object] = details or {}
        try:
            code = ErrorCode(code)
        except ValueError:
            code = ErrorCode.SYSTEM_ERROR
        self.code: ErrorCode = code
        self.message: str = message or DEFAULT_MESSAGES.get(code, code.name)
        super().__init__(f"{code.name} ({int(code)}): {self.message}")

    @property
    def retriable(self) -> bool:
        return self.code in RETRIABLE


class ProtocolError(OnceqError):
    """The byte stream itself is broken: the connection must be closed."""
