"""The replies and pushes of the onceq wire protocol: one typed message per request.

A reply is the success answer (code 0); an error answer is ``ErrorReply`` (the frame's code
is the error code). ``REPLY_OF`` names each request's reply type, so a client decodes an
answer with ``REPLY_OF[request code].decode(header, payload)``.
"""

from __future__ import annotations

from typing import Any

from .codes import PullStatus, PushCode, RequestCode
from .schema import Message, field, invalid, message, p_any, p_int, p_int_list


def p_status(name: str, value: Any) -> PullStatus:
    try:
        return PullStatus(value)
    except ValueError:
        raise invalid(f"field {name!r} is not a pull status: {value!r}") from None


@message()
class Empty(Message):
    """The answer of requests that have nothing to tell."""


@message()
class ErrorReply(Message):
    message: str = ""


@message()
class Pong(Message):
    time: int  # the broker's clock, ms since the epoch


@message()
class SendReply(Message):
    """Where a send's messages are: ``offsets``, one per message, in order. A message the
    dedup window recognised (index in ``dups``) keeps the offset (and the queue, in
    ``dupq``) of its first copy, so ``offsets`` may then be out of order."""

    queue: int
    offsets: list[int] = field(factory=list)
    dups: list[int] = field(factory=list)
    dupq: list[int] = field(factory=list)

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes = b"") -> SendReply:
        queue, base, n = header.get("queue"), header.get("base"), header.get("n")
        if type(queue) is not int:
            queue = p_int("queue", queue)
        if base is not None:  # every message stored anew: the first offset and the count
            if type(base) is not int or type(n) is not int:
                base, n = p_int("base", base), p_int("n", n)
            return cls(queue, list(range(base, base + n)))
        return cls(queue, p_int_list("offsets", header.get("offsets")),
                   p_int_list("dups", header.get("dups", [])),
                   p_int_list("dupq", header.get("dupq", [])))

    def encode(self) -> dict[str, Any]:
        offsets = self.offsets
        if not self.dups and offsets and offsets[-1] - offsets[0] == len(offsets) - 1:
            return {"queue": self.queue, "base": offsets[0], "n": len(offsets)}
        return {"queue": self.queue, "offsets": offsets, "dups": self.dups,
                "dupq": self.dupq}

    def queue_of(self, index: int) -> int:
        """The queue message ``index`` is stored on (a duplicate's first copy's)."""
        if index in self.dups:
            return self.dupq[self.dups.index(index)]
        return self.queue


@message()
class SequencedReply(Message):
    """An idempotent writer's batch: the first ``dup`` messages were stored before (by an
    earlier attempt); the other ``n`` are stored from ``base`` (None when ``n`` is 0)."""

    queue: int
    dup: int
    base: int | None = None
    n: int = 0

    def encode(self) -> dict[str, Any]:
        return {"queue": self.queue, "dup": self.dup,
                "base": -1 if self.base is None else self.base, "n": self.n}

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes = b"") -> SequencedReply:
        base = p_int("base", header.get("base", -1))
        return cls(p_int("queue", header.get("queue")), p_int("dup", header.get("dup")),
                   None if base < 0 else base, p_int("n", header.get("n")))


@message()
class SendBackReply(Message):
    """Where a failed message went: dead-lettered (``dlq``), else to the retry topic at
    delay ``level``; ``reconsume`` is its count of deliveries so far. A resend of a dead
    letter answers where its copy is in the retry topic (``queue``, ``offset``) and whether
    the dedup window found it there already (``duplicate``)."""

    dlq: bool = False
    reconsume: int = 0
    level: int | None = None
    queue: int | None = None
    offset: int | None = None
    duplicate: bool = False


@message()
class PullReply(Message):
    """The messages of a pull (``payload``: ``count`` records), where to continue (``next``)
    and the queue's bounds. ``behind`` is the group's committed offset when the pull's
    piggy-backed commit was below it; ``damaged`` the lost range [from, to) when DAMAGED."""

    status: PullStatus = field(wire="st", parse=p_status)
    next: int
    min: int
    max: int
    count: int = field(0, wire="n")
    behind: int | None = None
    damaged: list[int] | None = None
    payload: bytes = b""


@message()
class QueueOffsets(Message):
    min: int
    max: int


@message()
class OffsetReply(Message):
    offset: int  # of GET_OFFSET: -1 on the wire when the group has none there

    @property
    def committed(self) -> int | None:
        """``offset`` as a committed offset: None when the group has none."""
        return None if self.offset < 0 else self.offset


@message()
class Released(Message):
    released: bool


@message()
class GroupDeletedReply(Message):
    group: str
    queues: int  # committed offsets forgotten


@message()
class ResetReply(Message):
    group: str
    topic: str
    queues: list[Any]  # [queue, old offset, new offset]
    members: list[str] = field(factory=list)  # the live members a forced reset fenced
    gen: int = 0  # the forced reset's generation (0: not forced)


@message()
class TopicInfo(Message):
    topic: str
    queues: int  # queues consumers read (0..queues - 1)
    write_queues: int | None = None  # queues producers write (None: all ``queues``)


@message()
class QueueStateReply(Message):
    """A queue's ends here (``min``, ``max``) and each consumer group's committed offset."""

    min: int
    max: int
    offsets: dict[str, Any] = field(factory=dict)


@message()
class RouteInfo(Message):
    """Where a topic's queues live: ``placement[i]`` is the broker group of queue ``i``
    (empty: the topic has no route, every queue is on the broker asked, as on a standalone
    broker); ``groups``: per group its ``members`` (addresses) and ``leader`` (address, or
    None while nobody leads); ``here``: the group of the broker that answered (None: a
    standalone broker)."""

    topic: str
    placement: list[Any] = field(factory=list)
    version: int = 0
    groups: dict[str, Any] = field(factory=dict)
    here: str | None = None


@message()
class TopicList(Message):
    topics: list[Any]  # {"topic", "queues"} maps


@message()
class TopicStatusReply(Message):
    topic: str
    queues: list[Any]  # per queue {"queue", "min", "max", "first_store_ms", "last_store_ms"}
    # a topic whose queues follow a group: its counts, draining queues, gates
    scaling: dict[str, Any] | None = None


@message()
class HeartbeatReply(Message):
    """``holds``: [group, topic, queue, has-lock] the broker holds for the member;
    ``hold_s``: how long a silent holder keeps its queues (its lease), when the access lock
    applies; ``resets``: forced resets the member has not handled."""

    expiry_s: Any  # a number: seconds without a heartbeat before the member expires
    holds: list[Any] = field(factory=list)
    hold_s: Any = None
    resets: list[Any] | None = None


@message()
class GroupMembers(Message):
    group: str
    members: list[Any]


@message()
class GroupList(Message):
    groups: list[str]


@message()
class AccessLocks(Message):
    group: str
    enabled: bool
    queues: list[Any]
    orderly: list[Any] = field(factory=list)


@message()
class Locked(Message):
    locked: list[Any]  # [topic, queue] now held


@message()
class Unlocked(Message):
    unlocked: list[Any]  # [topic, queue] released


@message()
class StatusReply(Message):
    log_start: int
    log_end: int
    flush: str
    damaged: Any
    writes: Any
    dedup: Any
    delay_levels: list[Any]
    recent_errors: list[Any] = field(factory=list)  # {ts_ms, level, logger, message}
    # in a broker group: group, broker_id, role, epoch, hw, log_end, isr, lag, leader
    cluster: dict[str, Any] | None = None
    # the queue-depth fuse when on: limit, topics (per-topic limits), resume_ratio,
    # tripped ([topic, queue] of the queues refusing sends), refused (sends refused)
    fuse: dict[str, Any] | None = None
    # counters of the user topics (names not starting with %), for rates from two reads:
    # messages (ever stored: the sum of their queues' max offsets) and consumed (the sum
    # of every consumer group's committed offsets on them)
    counts: dict[str, Any] | None = None


@message()
class FoundMessages(Message):
    topic: str
    messages: list[Any]
    scanned: int
    truncated: bool
    begin_ms: int
    end_ms: int


@message()
class TraceReply(Message):
    group: Any
    enabled: bool
    groups: list[str]


@message()
class AuthReply(Message):
    """The server's SCRAM message; ``user`` once the exchange succeeded (then ``message`` is
    the server-final message, which the client verifies)."""

    message: str
    user: str | None = None


@message()
class UserInfo(Message):
    user: dict[str, Any]  # name, super, created, updated, mechanism: never a secret


@message()
class Users(Message):
    users: list[Any]


@message()
class AclChanged(Message):
    changed: bool  # False: the grant was already there (grant) or absent (revoke)


@message()
class Grants(Message):
    grants: list[Any]  # {"user", "kind", "pattern", "actions", "decision", "sources"}


@message()
class Routed(Message):
    """Where a reply went: to its requester's connection (``delivered``), else dropped and
    why (``reason``: ``late``, past the request's deadline; ``gone``, no connection has
    the reply channel)."""

    delivered: bool
    reason: str = ""


# ------------------------------------------------------------------ pushes
@message()
class ReplicaData(Message):
    """The leader's answer to a fetch: whole commit-log records from ``position``
    (``payload``), the leader's high watermark ``hw``, log end, ``epoch``, its leader-epoch
    entries (``epochs``: [epoch, start position]) and, when the follower's signature
    differs, its topics table (``topics``: [name, queues, created position, created ms])
    with its signature ``sig``."""

    epoch: int
    position: int
    hw: int
    end: int
    epochs: list[Any] = field(factory=list)
    sig: str = ""
    topics: list[Any] | None = None
    payload: bytes = b""


@message()
class EpochEnd(Message):
    """The largest leader epoch at or below the one asked for, and where it ends in the
    leader's log (-1, -1: the leader has no epoch that old)."""

    epoch: int
    end: int


@message(PushCode.GROUP_CHANGED)
class GroupChanged(Message):
    group: str
    client: str = ""
    reason: str = ""


@message(PushCode.ROUTE_CHANGED)
class RouteChanged(Message):
    """``topic``'s route changed (now at ``version``): clients fetch it again."""

    topic: str
    version: int = 0


@message(PushCode.OFFSETS_RESET)
class OffsetsReset(Message):
    group: str
    gen: int
    queues: list[Any]  # [topic, queue]


@message(PushCode.REPLY)
class ReplyPush(Message):
    """The reply to request ``id`` (``body``: bytes) on the requester's reply ``channel``."""

    channel: str
    id: str
    body: Any = field(None, parse=p_any)


PUSHES: dict[int, type[Message]] = {GroupChanged.CODE: GroupChanged,
                                    OffsetsReset.CODE: OffsetsReset,
                                    ReplyPush.CODE: ReplyPush,
                                    RouteChanged.CODE: RouteChanged}

R = RequestCode
REPLY_OF: dict[int, type[Message]] = {
    R.PING: Pong, R.SEND: SendReply, R.SEND_BATCH: SendReply,
    R.SEND_RECORDS: SendReply,
    R.SEND_SEQUENCED: SequencedReply, R.CONSUMER_SEND_BACK: SendBackReply,
    R.PULL: PullReply, R.QUERY_OFFSETS: QueueOffsets, R.SEARCH_OFFSET: OffsetReply,
    R.GET_OFFSET: OffsetReply, R.COMMIT_OFFSET: Empty, R.RELEASE_QUEUE: Released,
    R.RESET_OFFSETS: ResetReply, R.DELETE_GROUP: GroupDeletedReply,
    R.CREATE_TOPIC: TopicInfo, R.DELETE_TOPIC: Empty,
    R.LIST_TOPICS: TopicList, R.GET_TOPIC: TopicInfo, R.TOPIC_STATUS: TopicStatusReply,
    R.HEARTBEAT: HeartbeatReply, R.UNREGISTER: Empty, R.LIST_GROUP_MEMBERS: GroupMembers,
    R.LIST_GROUPS: GroupList, R.QUERY_ACCESS_LOCKS: AccessLocks, R.LOCK_QUEUES: Locked,
    R.UNLOCK_QUEUES: Unlocked, R.BROKER_STATUS: StatusReply, R.QUERY_MESSAGE: FoundMessages,
    R.GROUP_TRACE: TraceReply, R.AUTHENTICATE: AuthReply, R.USER_CREATE: UserInfo,
    R.USER_UPDATE: UserInfo, R.USER_DELETE: Empty, R.USER_LIST: Users,
    R.ACL_GRANT: AclChanged, R.ACL_REVOKE: AclChanged, R.ACL_LIST: Grants,
    R.REPLICA_FETCH: ReplicaData, R.REPLICA_EPOCH_END: EpochEnd,
    R.REPLY_CHANNEL: Empty, R.REPLY: Routed, R.GET_ROUTE: RouteInfo,
    R.QUEUE_STATE: QueueStateReply, R.COPY_QUEUE: QueueStateReply,
}
