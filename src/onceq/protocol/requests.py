"""The requests of the onceq wire protocol, one typed message per request code.

Each is decoded once, where the frame arrives (``Message.decode``): a missing or mistyped
field is ``INVALID_ARGUMENT`` (with its name) before any service sees the request. What
depends on the broker's state or configuration (names, topic existence, clamps to the
configured maxima) is checked by the service that handles the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .codes import RequestCode
from .errors import ErrorCode, OnceqError
from .schema import Message, field, invalid, is_int64, message, p_any, p_int

CLUSTERING, BROADCASTING = "CLUSTERING", "BROADCASTING"  # message models
MAX_QUEUES = 4096  # queues in one lock or unlock request


def p_gen(name: str, value: Any) -> int | None:
    """``reset_gen``: the forced-reset generation a member has handled (anything but an
    integer counts as none, as older clients may send)."""
    return value if type(value) is int else None


def p_offset(name: str, value: Any) -> int | None:
    """An offset to commit, where a negative one (older clients' -1) means none."""
    value = p_int(name, value)
    return value if value >= 0 else None


def p_seq(name: str, value: Any) -> int:
    if type(value) is not int or not 0 <= value < 2 ** 62:
        raise OnceqError(ErrorCode.INVALID_SEQUENCE, "epoch and seq must be integers >= 0")
    return value


def _triples(value: Any, what: str) -> list[tuple[str, int, int]]:
    if not isinstance(value, list) or not all(
            isinstance(x, list) and len(x) == 3 and isinstance(x[0], str)
            and all(is_int64(v) for v in x[1:]) for x in value):
        raise invalid(f"{what} must be a list of [topic, queue, next offset]")
    return [(t, q, d) for t, q, d in value]


@dataclass(frozen=True, slots=True)
class QueueRef:
    topic: str
    queue: int
    offset: int | None = None  # the offset to commit first (unlock); None: none


def _queue_refs(with_offset: bool) -> Any:
    n = 3 if with_offset else 2
    what = "[topic, queue, offset]" if with_offset else "[topic, queue]"

    def parse(name: str, value: Any) -> list[QueueRef]:
        if not isinstance(value, list) or len(value) > MAX_QUEUES or not all(
                isinstance(x, list) and len(x) == n and isinstance(x[0], str)
                and all(is_int64(v) for v in x[1:]) for x in value):
            raise invalid(f"queues must be a list of at most {MAX_QUEUES} {what}")
        if with_offset:
            return [QueueRef(x[0], x[1], x[2] if x[2] >= 0 else None) for x in value]
        return [QueueRef(x[0], x[1]) for x in value]

    return parse


@dataclass(frozen=True, slots=True)
class GroupBeat:
    """One group of a heartbeat: the member's subscriptions and the queues it holds."""

    group: Any  # the group name, checked by the service (names are the store's rule)
    subs: dict[str, str]  # topic -> tag expression
    model: str = CLUSTERING
    meta: dict[str, Any] | None = None
    held: list[tuple[str, int, int]] | None = None  # [topic, queue, next offset]
    reset_gen: int | None = None

    def encode(self) -> dict[str, Any]:
        out: dict[str, Any] = {"group": self.group, "subs": self.subs, "model": self.model}
        if self.meta is not None:
            out["meta"] = self.meta
        if self.held is not None:
            out["held"] = [list(x) for x in self.held]
        if self.reset_gen is not None:
            out["reset_gen"] = self.reset_gen
        return out


def p_groups(name: str, value: Any) -> list[GroupBeat]:
    if not isinstance(value, list):
        raise invalid("groups must be a list")
    out = []
    for g in value:  # everything is checked first: a bad heartbeat changes nothing
        if not isinstance(g, dict):
            raise invalid("each group must be a map")
        subs = g.get("subs", {})
        if not isinstance(subs, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in subs.items()):
            raise invalid("subs must be a map of topic -> tag expression")
        model = g.get("model", CLUSTERING)
        if model not in (CLUSTERING, BROADCASTING):
            raise invalid(f"model must be {CLUSTERING} or {BROADCASTING}")
        meta = g.get("meta")
        if meta is not None and not isinstance(meta, dict):
            raise invalid("meta must be a map")
        held = g.get("held")
        out.append(GroupBeat(g.get("group"), subs, model, meta,
                             None if held is None else _triples(held, "held"),
                             p_gen("reset_gen", g.get("reset_gen"))))
    return out


def _enc_groups(groups: list[GroupBeat]) -> list[dict[str, Any]]:
    return [g.encode() for g in groups]


# ------------------------------------------------------------------ sends
@message(RequestCode.SEND)
class Send(Message):
    """Messages for one queue: the payload is a batch of ``[u32 length][message]``."""

    topic: str
    queue: int
    payload: bytes = b""


@message(RequestCode.SEND_BATCH)
class SendBatch(Send):
    """``SEND`` of several messages (the same fields)."""


@message(RequestCode.SEND_RECORDS)
class SendRecords(Send):
    """Messages for one queue as one record batch (``log/batch.py``): the broker checks
    the batch and stores its bytes as they are."""


@message(RequestCode.SEND_SEQUENCED)
class SendSequenced(Message):
    """An idempotent writer's numbered batch: messages ``seq``.. of ``writer`` in ``epoch``."""

    topic: str
    queue: int
    writer: Any = field(parse=p_any)  # checked by the sequence table's own rule
    epoch: int = field(parse=p_seq)
    seq: int = field(parse=p_seq)
    payload: bytes = b""


@message(RequestCode.CONSUMER_SEND_BACK)
class SendBack(Message):
    """A message the consumer failed: to the group's retry topic, or its dead-letter topic.
    With ``resend``, the dead letter at ``offset`` goes back to the retry topic."""

    group: str
    topic: str
    queue: int
    offset: int
    delay_level: int = 0
    max_reconsume: int = 16
    dlq_reason: str = ""
    resend: bool = False


# ------------------------------------------------------------------ pulls and offsets
@message(RequestCode.PULL)
class Pull(Message):
    topic: str
    queue: int
    offset: int
    max_msgs: int = field(32, wire="max")
    max_bytes: int | None = None  # None: the broker's maximum
    suspend_ms: int = 0  # long polling: hold an empty pull this long at most
    tags: list[str] | None = None
    group: str | None = None  # a member's pull: under the group's queue ownership
    client: str | None = None
    commit: int | None = None  # the group's ack offset on this queue, piggy-backed
    reset_gen: int | None = field(None, parse=p_gen)


@message(RequestCode.QUERY_OFFSETS)
class QueryOffsets(Message):
    topic: str
    queue: int


@message(RequestCode.SEARCH_OFFSET)
class SearchOffset(Message):
    topic: str
    queue: int
    ts: int  # ms since the epoch


@message(RequestCode.GET_OFFSET)
class GetOffset(Message):
    group: str
    topic: str
    queue: int


@message(RequestCode.COMMIT_OFFSET)
class CommitOffset(Message):
    group: str
    topic: str
    queue: int
    offset: int
    client: str | None = None
    reset_gen: int | None = field(None, parse=p_gen)


@message(RequestCode.RELEASE_QUEUE)
class ReleaseQueue(Message):
    """End of a drain: commit ``offset`` (None: nothing to commit), give the queue up."""

    group: str
    client: str
    topic: str
    queue: int
    offset: int | None = field(None, parse=p_offset)
    reset_gen: int | None = field(None, parse=p_gen)


@message(RequestCode.RESET_OFFSETS)
class ResetOffsets(Message):
    """Admin: move ``group``'s offsets on ``topic``: ``offsets`` is [[queue, offset], ...]
    or a map queue -> offset (checked against the topic's queues by the service)."""

    group: str
    topic: str
    offsets: Any = field(None, parse=p_any)
    force: bool = False


@message(RequestCode.DELETE_GROUP)
class DeleteGroup(Message):
    """Admin: forget ``group``'s committed offsets (refused while it has live members)."""

    group: str


# ------------------------------------------------------------------ topics
@message(RequestCode.CREATE_TOPIC)
class CreateTopic(Message):
    topic: str
    queues: int | None = None  # None: the broker's default
    exclusive: bool = False  # refuse a topic that exists
    # queues that follow a consumer group (docs/queue_scaling.md): "" stops following;
    # min and max bound the write count (default 1 and the topic's queue count)
    follow_group: str | None = None
    min_queues: int | None = None
    max_queues: int | None = None
    key_order: bool = True  # a queue receiving moved keys waits for the queues they left
    # in a cluster of several broker groups: the group of each queue (default: an even
    # spread over the groups registered now); refused on a standalone broker
    placement: list[Any] | None = None


@message(RequestCode.DELETE_TOPIC)
class DeleteTopic(Message):
    topic: str


@message(RequestCode.LIST_TOPICS)
class ListTopics(Message):
    pass


@message(RequestCode.GET_TOPIC)
class GetTopic(Message):
    topic: str


@message(RequestCode.TOPIC_STATUS)
class TopicStatus(Message):
    topic: str


# ------------------------------------------------------------------ members and locks
@message(RequestCode.HEARTBEAT)
class Heartbeat(Message):
    client: str
    groups: list[GroupBeat] = field(parse=p_groups, factory=list)

    def encode(self) -> dict[str, Any]:
        return {"client": self.client, "groups": _enc_groups(self.groups)}


@message(RequestCode.UNREGISTER)
class Unregister(Message):
    group: str
    client: str


@message(RequestCode.LIST_GROUP_MEMBERS)
class ListGroupMembers(Message):
    group: str


@message(RequestCode.LIST_GROUPS)
class ListGroups(Message):
    pass


@message(RequestCode.QUERY_ACCESS_LOCKS)
class QueryAccessLocks(Message):
    group: str


@message(RequestCode.LOCK_QUEUES)
class LockQueues(Message):
    """Orderly: lock (or renew) queues of ``group``."""

    group: Any = field(parse=p_any)  # checked by the service (the store's rule)
    client: str
    queues: list[QueueRef] = field(parse=_queue_refs(False))
    reset_gen: int | None = field(None, parse=p_gen)

    def encode(self) -> dict[str, Any]:
        return {**Message.encode(self), "queues": [[r.topic, r.queue] for r in self.queues]}


@message(RequestCode.UNLOCK_QUEUES)
class UnlockQueues(Message):
    """Orderly: commit each queue's offset (when not None), then release its lock."""

    group: Any = field(parse=p_any)
    client: str
    queues: list[QueueRef] = field(parse=_queue_refs(True))
    reset_gen: int | None = field(None, parse=p_gen)

    def encode(self) -> dict[str, Any]:
        queues = [[r.topic, r.queue, -1 if r.offset is None else r.offset]
                  for r in self.queues]
        return {**Message.encode(self), "queues": queues}


# ------------------------------------------------------------------ admin
@message(RequestCode.PING)
class Ping(Message):
    pass


@message(RequestCode.BROKER_STATUS)
class BrokerStatus(Message):
    counts: bool = False  # also count the messages stored and consumed (every queue read)


@message(RequestCode.QUERY_MESSAGE)
class QueryMessage(Message):
    """Find messages by unique key (``by="unique"``) or business key (``by="key"``)."""

    topic: Any = field(None, parse=p_any)  # checked by the service (its own messages)
    key: Any = field(None, parse=p_any)
    by: Any = field(None, parse=p_any)  # None: "unique"
    begin_ms: Any = field(None, parse=p_any)
    end_ms: Any = field(None, parse=p_any)
    max_scan: Any = field(None, parse=p_any)
    max_results: Any = field(None, parse=p_any)


@message(RequestCode.GROUP_TRACE)
class GroupTrace(Message):
    """Turn ``group``'s delivery trace on or off (None: leave it); list the traced groups."""

    group: Any = field(None, parse=p_any)
    enabled: Any = field(None, parse=p_any)


# ------------------------------------------------------------------ security
@message(RequestCode.AUTHENTICATE)
class Authenticate(Message):
    """One step of the connection's SCRAM-SHA-256 exchange: the client-first message, then
    the client-final message (``protocol/scram.py``)."""

    message: str
    mechanism: str = "SCRAM-SHA-256"


@message(RequestCode.USER_CREATE)
class UserCreate(Message):
    """A new user with SCRAM credentials derived by the client (``make_credentials``): the
    password itself never reaches the broker."""

    name: str
    credentials: dict[str, Any]
    super: bool = False


@message(RequestCode.USER_UPDATE)
class UserUpdate(Message):
    name: str
    credentials: dict[str, Any] | None = None
    super: bool | None = None


@message(RequestCode.USER_DELETE)
class UserDelete(Message):
    name: str


@message(RequestCode.USER_LIST)
class UserList(Message):
    pass


@message(RequestCode.ACL_GRANT)
class AclGrant(Message):
    """Allow (or deny) ``actions`` on resources of ``kind`` named ``pattern`` to ``user``,
    from ``sources`` (networks; empty: anywhere)."""

    user: str
    kind: str
    pattern: str
    actions: list[str]
    decision: str = "Allow"
    sources: list[str] = field(factory=list)


@message(RequestCode.ACL_REVOKE)
class AclRevoke(AclGrant):
    """Remove a grant (the same fields as it was granted with)."""


@message(RequestCode.ACL_LIST)
class AclList(Message):
    user: str | None = None


# ------------------------------------------------------------------ broker groups
@message(RequestCode.REPLICA_FETCH)
class ReplicaFetch(Message):
    """A follower's fetch of the leader's commit log from ``position`` (its own log end,
    which acknowledges everything before it), under leader ``epoch``; held up to
    ``wait_ms`` while the leader has nothing after it. ``topics`` is the signature of the
    follower's topics table (the answer carries the leader's when they differ)."""

    group: str
    broker: str
    epoch: int
    position: int
    max_bytes: int = 1024 * 1024
    wait_ms: int = 0
    topics: str = ""


@message(RequestCode.REPLICA_EPOCH_END)
class ReplicaEpochEnd(Message):
    """Where leader epoch ``epoch`` ends in the leader's log (Kafka's
    OffsetsForLeaderEpoch): a returning replica cuts its log there."""

    group: str
    broker: str
    epoch: int


# ------------------------------------------------------------------ request-reply
@message(RequestCode.REPLY_CHANNEL)
class ReplyChannel(Message):
    """A requester's reply channel (its own name, unique per requester): the broker sends
    the replies of its requests to this connection until it closes."""

    channel: str


@message(RequestCode.REPLY)
class RouteReply(Message):
    """A responder's reply to request ``id`` of reply channel ``channel`` (both from the
    request's properties), with the request's ``topic``, its ``deadline`` and the time it
    was sent (``born``), ms since the epoch (0: none); ``payload`` is the reply's body."""

    channel: str
    id: str
    topic: str = ""
    deadline: int = 0
    born: int = 0
    payload: bytes = b""


@message(RequestCode.GET_ROUTE)
class GetRoute(Message):
    """Where the queues of ``topic`` live (any broker of a cluster answers)."""

    topic: str


@message(RequestCode.QUEUE_STATE)
class QueueState(Message):
    """A queue's ends and every consumer group's committed offset on the broker asked,
    whatever its route says (moving a queue: ``onceq topic reassign``)."""

    topic: str
    queue: int


@message(RequestCode.COPY_QUEUE)
class CopyQueue(Message):
    """Copy of a moving queue into the group it moves to: ``payload`` (message parts as
    ``SEND_BATCH`` carries them) stored from offset ``start`` (the queue's end here, else
    nothing is stored), and ``offsets`` (group -> committed offset) taken where higher.
    ``restart``: an empty queue here first restarts at a higher ``start`` (the first
    offset the group it leaves still holds). Answered with the queue's state after it."""

    topic: str
    queue: int
    start: int = 0
    offsets: dict[str, Any] | None = None
    payload: bytes = b""
    restart: bool = False


REQUESTS: dict[int, type[Message]] = {
    cls.CODE: cls for cls in (
        Send, SendBatch, SendRecords, SendSequenced, SendBack, Pull, QueryOffsets, SearchOffset,
        GetOffset, CommitOffset, ReleaseQueue, ResetOffsets, DeleteGroup, CreateTopic,
        DeleteTopic, ListTopics, GetTopic, TopicStatus, Heartbeat, Unregister, ListGroupMembers,
        ListGroups, QueryAccessLocks, LockQueues, UnlockQueues, Ping, BrokerStatus,
        QueryMessage, GroupTrace, Authenticate, UserCreate, UserUpdate, UserDelete, UserList,
        AclGrant, AclRevoke, AclList, ReplicaFetch, ReplicaEpochEnd, ReplyChannel,
        RouteReply, GetRoute, QueueState, CopyQueue)
}
