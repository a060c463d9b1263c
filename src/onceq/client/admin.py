"""Administration: topics, consumer groups and their dead letters."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..log.record import MessageExt, decode_records
from ..protocol.codes import (
    PROP_ORIGIN_TOPIC,
    RETRY_PREFIX,
    PullStatus,
    dlq_topic,
    retry_topic,
)
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import (
    AccessLocks,
    GroupDeletedReply,
    GroupList,
    GroupMembers,
    OffsetReply,
    Pong,
    PullReply,
    QueueOffsets,
    ResetReply,
    SendBackReply,
    StatusReply,
    TopicList,
    TopicStatusReply,
    TraceReply,
)
from ..protocol.requests import (
    AclGrant,
    AclList,
    AclRevoke,
    BrokerStatus,
    CreateTopic,
    DeleteGroup,
    DeleteTopic,
    GetOffset,
    GroupTrace,
    ListGroupMembers,
    ListGroups,
    ListTopics,
    Ping,
    Pull,
    QueryAccessLocks,
    QueryMessage,
    QueryOffsets,
    ResetOffsets,
    SearchOffset,
    SendBack,
    TopicStatus,
    UserCreate,
    UserDelete,
    UserList,
    UserUpdate,
)
from ..protocol.schema import Message
from ..protocol.scram import make_credentials
from .allocation import MessageQueue, allocate_average
from .base import BrokerClient
from .connection import ConnectionLost
from .security import ClientSecurity


@dataclass(slots=True)
class MemberInfo:
    client_id: str
    model: str
    subscriptions: dict[str, str]
    heartbeat_age_s: float  # seconds since the broker last heard from the member
    peer: str = ""


@dataclass(slots=True)
class QueueStatus:
    topic: str
    queue_id: int
    min_offset: int
    max_offset: int
    committed: int | None  # None: the group has committed nothing on this queue
    expected_owner: str | None = None  # owner under AVERAGE allocation (None: no member)
    lock_holder: str | None = None  # access-lock holder (None: not locked)
    deliver_offset: int | None = None  # next offset after the last pull that found messages
    handover_pending: bool = False  # another member was refused: a handover is waiting
    orderly_holder: str | None = None  # orderly queue-lock holder (None: not locked)
    orderly_age_s: float | None = None  # seconds since that lock was granted
    fuse_limit: int | None = None  # the queue-depth fuse's limit (None: no fuse)
    fuse_tripped: bool = False  # sends to the queue refused QUEUE_FULL now

    @property
    def lag(self) -> int:
        """Messages not yet consumed (from the queue's minimum when nothing is committed)."""
        done = self.min_offset if self.committed is None else self.committed
        return self.max_offset - max(done, self.min_offset)


@dataclass(slots=True)
class GroupStatus:
    group: str
    members: list[MemberInfo] = field(default_factory=list)
    queues: list[QueueStatus] = field(default_factory=list)

    @property
    def lag(self) -> int:
        return sum(q.lag for q in self.queues)


@dataclass(slots=True)
class OffsetReset:
    """One queue of an offset reset."""

    queue_id: int
    old_offset: int | None  # None: the group had no offset there
    new_offset: int


@dataclass(slots=True)
class ResendResult:
    """Where one dead letter went (``error`` set when it could not be resent)."""

    dlq_offset: int
    unique_key: str
    topic: str = ""
    queue_id: int | None = None  # where its copy went (None: not resent)
    offset: int | None = None
    duplicate: bool = False  # already resent within the broker's dedup window
    error: str | None = None


class Admin(BrokerClient):
    """Administration of topics and consumer groups."""

    def __init__(self, address: str = "127.0.0.1:9876", *,
                 security: ClientSecurity | None = None) -> None:
        super().__init__(address, security=security)

    async def create_topic(self, topic: str, queues: int = 8, *, exclusive: bool = False,
                           placement: Sequence[str] | None = None,
                           groups: Sequence[str] | None = None) -> dict[str, Any]:
        """Create a topic, or grow its queue count (``exclusive``: fail if it exists). In a
        cluster of several broker groups: ``placement``, the group of each queue, or
        ``groups``, the groups to spread the queues over evenly (default: all)."""
        if groups is not None:  # (the cluster package only when asked: a client's import
            from ..cluster._routes import place  # stays light)

            placement = place(queues, list(groups))
        where = None if placement is None else [str(g) for g in placement]
        if where is not None and len(where) != queues:
            raise ValueError(f"placement names {len(where)} groups for {queues} queues")
        t = _fields(await self._call(CreateTopic(topic, queues, exclusive,
                                                 placement=where)))
        if t.get("write_queues") is None:  # all its queues written: not said
            t.pop("write_queues", None)
        return t

    async def follow_group(self, topic: str, group: str | None, *, min_queues: int = 1,
                           max_queues: int | None = None, queues: int | None = None,
                           key_order: bool = True) -> dict[str, Any]:
        """Make ``topic`` (created when missing, with ``queues`` or ``min_queues`` queues)
        read and write as many queues as ``group`` has members, as a power of two within
        ``min_queues..max_queues`` (default: the topic's queue count); ``group`` None
        freezes its counts where they are. ``key_order``: a queue that receives moved keys
        waits until the queues they come from are consumed (docs/queue_scaling.md). The
        topic's ``queues`` (read) and ``write_queues`` as they are now."""
        return _fields(await self._call(CreateTopic(
            topic, queues, False, group or "", min_queues, max_queues, key_order)))

    async def topic_scaling(self, topic: str) -> dict[str, Any] | None:
        """The queue scaling of ``topic`` (None when it follows no group): ``group``,
        ``members``, ``read``, ``write``, ``draining`` queues and the groups they wait
        for, ``gates``."""
        reply: TopicStatusReply = await self._call(TopicStatus(topic))
        return reply.scaling

    async def delete_topic(self, topic: str) -> None:
        await self._call(DeleteTopic(topic))

    async def list_topics(self) -> list[dict[str, Any]]:
        reply: TopicList = await self._call(ListTopics())
        return reply.topics

    async def queue_count(self, topic: str) -> int:
        return await self.links.queue_count(topic)

    async def queue_offsets(self, topic: str, queue: int) -> tuple[int, int]:
        reply: QueueOffsets = await self.links.call_at(topic, queue, QueryOffsets(topic, queue))
        return reply.min, reply.max

    async def topic_offsets(self, topic: str) -> list[tuple[int, int]]:
        n = await self.queue_count(topic)
        return [await self.queue_offsets(topic, q) for q in range(n)]

    async def group_offset(self, group: str, topic: str, queue: int) -> int | None:
        """``group``'s committed offset on the queue, None when it has none."""
        reply: OffsetReply = await self.links.call_at(topic, queue,
                                                      GetOffset(group, topic, queue))
        return reply.committed

    async def reset_offsets(self, group: str, topic: str, *, to_offset: int | None = None,
                            to_time_ms: int | None = None, queue: int | None = None,
                            force: bool = False) -> list[OffsetReset]:
        """Move ``group``'s offsets on ``topic`` (every queue, or ``queue``) to ``to_offset``
        or to the first message stored at or after ``to_time_ms``; the broker clamps each
        to its queue's [min, max].

        Refused with GROUP_ACTIVE while the group has live members, unless ``force``: then
        the members drop those queues and read again from the new offsets."""
        if (to_offset is None) == (to_time_ms is None):
            raise ValueError("give exactly one of to_offset and to_time_ms")
        queues = [queue] if queue is not None else range(await self.queue_count(topic))
        targets = []
        for q in queues:
            if to_offset is not None:
                targets.append([q, to_offset])
            else:
                assert to_time_ms is not None
                found: OffsetReply = await self._call(SearchOffset(topic, q, to_time_ms))
                targets.append([q, found.offset])
        reply: ResetReply = await self._call(ResetOffsets(group, topic, targets, force))
        return [OffsetReset(int(q), None if old < 0 else int(old), int(new))
                for q, old, new in reply.queues]

    async def delete_group(self, group: str) -> int:
        """Forget ``group``'s committed offsets on the broker (its group of brokers); how
        many queues had one. Refused with GROUP_ACTIVE while the group has live members,
        GROUP_NOT_EXIST for a group the broker does not know. A later commit (a member
        joining again) starts the group afresh, from its ``consume_from``."""
        reply: GroupDeletedReply = await self._call(DeleteGroup(group))
        return reply.queues

    async def list_groups(self) -> list[str]:
        reply: GroupList = await self._call(ListGroups())
        return reply.groups

    async def group_members(self, group: str) -> list[dict[str, Any]]:
        reply: GroupMembers = await self._call(ListGroupMembers(group))
        return reply.members

    async def ping(self) -> int:
        reply: Pong = await self._call(Ping())
        return reply.time

    # ---------------------------------------------------------------- group status
    async def group_topics(self, group: str) -> list[str]:
        """Topics on which ``group`` has a committed offset (its own retry topic included;
        other internal topics are skipped)."""
        out = []
        for t in await self.list_topics():
            name = t["topic"]
            if name.startswith("%") and name != retry_topic(group):
                continue
            for q in range(int(t["queues"])):
                if await self.group_offset(group, name, q) is not None:
                    out.append(name)
                    break
        return out

    async def group_status(self, group: str) -> GroupStatus:
        """Members of ``group`` and, per queue of the topics they subscribe to (or, with no
        member online, of the topics the group has offsets on): offsets, lag and the member
        the AVERAGE strategy assigns the queue to (what members on the default strategy
        do). Raises GROUP_NOT_EXIST for a group the broker has never seen."""
        raw = await self.group_members(group)
        now_ms = await self.ping()
        members = [MemberInfo(m["client"], m.get("model", "CLUSTERING"),
                              dict(m.get("subs") or {}),
                              max(0.0, (now_ms - int(m.get("last_heartbeat_ms", now_ms))) / 1000),
                              str(m.get("peer", "")))
                   for m in raw]
        topics = sorted({t for m in members for t in m.subscriptions})
        if not members:
            topics = await self.group_topics(group)
        ids = [m.client_id for m in members]
        broadcast = bool(members) and all(m.model == "BROADCASTING" for m in members)
        status = GroupStatus(group, members)
        held: AccessLocks = await self._call(QueryAccessLocks(group))
        fuse = await self._fuse()
        limits = {} if fuse is None else dict(fuse.get("topics") or {})
        tripped = set() if fuse is None else {tuple(k) for k in fuse.get("tripped", [])}
        locks = {(r["topic"], r["queue"]): r for r in held.queues}
        orderly = {(r["topic"], r["queue"]): r for r in held.orderly}
        for topic in topics:
            try:
                n = await self.queue_count(topic)
            except OnceqError as exc:
                if exc.code == ErrorCode.TOPIC_NOT_EXIST:
                    continue  # subscribed, not created (yet)
                raise
            mqs = [MessageQueue(topic, q) for q in range(n)]
            owner: dict[MessageQueue, str] = {}
            if ids and not broadcast:
                for cid in ids:
                    for mq in allocate_average(cid, mqs, ids):
                        owner[mq] = cid
            for mq in mqs:
                lo, hi = await self.queue_offsets(topic, mq.queue_id)
                committed = await self.group_offset(group, topic, mq.queue_id)
                who = "(every member)" if broadcast else owner.get(mq)
                lock = locks.get((topic, mq.queue_id), {})
                ordered = orderly.get((topic, mq.queue_id), {})
                limit = None if fuse is None else limits.get(topic, fuse.get("limit"))
                status.queues.append(QueueStatus(
                    topic, mq.queue_id, lo, hi, committed, who, lock.get("holder"),
                    lock.get("deliver"), bool(lock.get("pending_handover")),
                    ordered.get("holder"), ordered.get("age_s"), limit or None,
                    (topic, mq.queue_id) in tripped))
        return status

    async def _fuse(self) -> dict[str, Any] | None:
        """The broker's queue-depth fuse (None when it is off, or when this user may not
        read the broker's status)."""
        try:
            reply: StatusReply = await self._call(BrokerStatus())
        except OnceqError as exc:
            if exc.code == ErrorCode.ACCESS_DENIED:
                return None
            raise
        return reply.fuse

    async def access_locks(self, group: str) -> list[dict[str, Any]]:
        """The broker's transition-state access locks of ``group``: per locked queue the
        holder, deliver and ack offsets, and whether a handover is pending."""
        reply: AccessLocks = await self._call(QueryAccessLocks(group))
        return reply.queues

    async def queue_locks(self, group: str) -> list[dict[str, Any]]:
        """The broker's orderly queue locks of ``group``: per locked queue the holder,
        ``age_s`` (since granted) and ``renewed_s`` (since the last renewal)."""
        reply: AccessLocks = await self._call(QueryAccessLocks(group))
        return reply.orderly

    # ---------------------------------------------------------------- inspection
    async def topic_status(self, topic: str) -> list[dict[str, Any]]:
        """Per queue of ``topic``: ``queue``, ``min``, ``max``, ``first_store_ms`` and
        ``last_store_ms`` (None for an empty queue)."""
        reply: TopicStatusReply = await self._call(TopicStatus(topic))
        return reply.queues

    async def query_message(self, topic: str, key: str, *, by: str = "unique",
                            begin_ms: int | None = None, end_ms: int | None = None,
                            max_scan: int | None = None, max_results: int | None = None
                            ) -> dict[str, Any]:
        """Messages of ``topic`` whose unique key (``by="unique"``) or one of whose
        business keys (``by="keys"``) is ``key``: a bounded scan on the broker (see
        ``broker/admin_ops.py`` for its range and cost). Answers ``messages`` (queue, offset,
        store time, ...), ``scanned`` and ``truncated``; MESSAGE_NOT_FOUND when none."""
        return _fields(await self._call(QueryMessage(topic, key, by, begin_ms, end_ms,
                                                     max_scan, max_results)))

    async def group_trace(self, group: str, enabled: bool | None = None) -> bool:
        """Turn ``group``'s delivery trace on or off (None: leave it); whether it is on."""
        reply: TraceReply = await self._call(GroupTrace(group, enabled))
        return bool(reply.enabled)

    # ---------------------------------------------------------------- users and grants
    async def create_user(self, name: str, password: str, *, super: bool = False
                          ) -> dict[str, Any]:
        """A new user of the broker. The password is turned into SCRAM credentials here:
        it never reaches the broker. Answers the user's public view (no secret)."""
        creds = make_credentials(password).to_dict()
        return (await self._call(UserCreate(name, creds, super))).user

    async def update_user(self, name: str, *, password: str | None = None,
                          super: bool | None = None) -> dict[str, Any]:
        """A new password and/or super flag; connections open as the user stay open."""
        creds = None if password is None else make_credentials(password).to_dict()
        return (await self._call(UserUpdate(name, creds, super))).user

    async def delete_user(self, name: str) -> None:
        """Remove a user and its grants; its connections lose access at once."""
        await self._call(UserDelete(name))

    async def list_users(self) -> list[dict[str, Any]]:
        return (await self._call(UserList())).users

    async def grant(self, user: str, kind: str, pattern: str, actions: Iterable[str], *,
                    decision: str = "Allow", sources: Iterable[str] = ()) -> bool:
        """Allow (or, ``decision="Deny"``, deny) ``actions`` on the resources of ``kind``
        (Topic, Group, Cluster) named ``pattern`` (a name, ``prefix*`` or ``*``) to
        ``user``, from ``sources`` (networks). Whether the grant is new."""
        req = AclGrant(user, kind, pattern, list(actions), decision, list(sources))
        return (await self._call(req)).changed

    async def revoke(self, user: str, kind: str, pattern: str, actions: Iterable[str], *,
                     decision: str = "Allow", sources: Iterable[str] = ()) -> bool:
        """Remove a grant given with the same arguments; whether there was one."""
        req = AclRevoke(user, kind, pattern, list(actions), decision, list(sources))
        return (await self._call(req)).changed

    async def list_grants(self, user: str | None = None) -> list[dict[str, Any]]:
        return (await self._call(AclList(user))).grants

    # ---------------------------------------------------------------- dead letters
    async def broker_status(self) -> dict[str, Any]:
        """Store health: ``log_start``, ``log_end``, ``flush``, ``damaged`` (the commit-log
        positions and, per topic and queue, the offsets lost to disk damage), ``writes``,
        ``dedup`` (``window_s``, ``effective_window_s``: shorter while the key cap forgets
        keys younger than the window, ``keys``, ``max_keys``), ``delay_levels`` (the
        retry delays in seconds, level 1 first) and ``recent_errors`` (the broker's last
        warnings and errors since it started, oldest first: ``ts_ms``, ``level``,
        ``logger``, ``message``)."""
        return _fields(await self._call(BrokerStatus()))

    async def dead_letter_offsets(self, group: str) -> tuple[int, int] | None:
        """(min, max) offsets of the group's dead-letter queue; None when it has none
        (GROUP_NOT_EXIST when the broker does not know the group at all)."""
        try:
            return await self.queue_offsets(dlq_topic(group), 0)
        except OnceqError as exc:
            if exc.code != ErrorCode.TOPIC_NOT_EXIST:
                raise
        await self.group_members(group)  # GROUP_NOT_EXIST for an unknown group
        return None

    async def dead_letters(self, group: str, max_msgs: int = 100, start: int | None = None
                           ) -> list[MessageExt]:
        """Up to ``max_msgs`` messages of ``%DLQ%<group>`` from ``start`` (default: the
        oldest)."""
        rng = await self.dead_letter_offsets(group)
        if rng is None:
            return []
        offset = rng[0] if start is None else max(start, rng[0])
        out: list[MessageExt] = []
        while len(out) < max_msgs and offset < rng[1]:
            batch = await self._pull(dlq_topic(group), offset, min(max_msgs - len(out), 256))
            if not batch:
                break
            out.extend(batch)
            offset = batch[-1].queue_offset + 1
        return out[:max_msgs]

    async def _pull(self, topic: str, offset: int, n: int) -> list[MessageExt]:
        reply: PullReply = await self._call(Pull(topic, 0, offset, n))
        if reply.status != PullStatus.FOUND or not reply.payload:
            return []
        return list(decode_records(reply.payload, True, offset, reply.next))

    async def resend_dead_letters(self, group: str, offsets: Iterable[int] | None = None
                                  ) -> list[ResendResult]:
        """Send dead letters of ``group`` back to the group (all of them when ``offsets`` is
        None) through its retry topic ``%RETRY%<group>``: only this group consumes them
        again (other groups of the origin topic already did), and consumers see the origin
        topic as the message's topic.

        A resent message keeps its unique key (consumers can recognise it) and its
        reconsume count. The broker's dedup window keys on (topic, unique key, reconsume
        count): with the count kept, a resend is not mistaken for a producer retry of the
        original message, and resending the same dead letter twice within the window stores
        it once (``duplicate``). Because the count is kept, a resent message that fails
        again goes straight back to the dead-letter queue.
        """
        if offsets is None:
            letters = await self.dead_letters(group, max_msgs=2 ** 31)
        else:
            letters = []
            rng = await self.dead_letter_offsets(group)
            for off in dict.fromkeys(offsets):
                got = await self._pull(dlq_topic(group), off, 1) if rng and \
                    rng[0] <= off < rng[1] else []
                if not got or got[0].queue_offset != off:
                    raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                                     f"no dead letter of group {group!r} at offset {off}")
                letters.append(got[0])
        return [await self._resend(m, group) for m in letters]

    async def _resend(self, m: MessageExt, group: str) -> ResendResult:
        res = ResendResult(m.queue_offset, m.unique_key)
        origin = m.properties.get(PROP_ORIGIN_TOPIC)
        if not origin or origin.startswith(RETRY_PREFIX):
            res.error = "no origin topic in its properties"
            return res
        res.topic = retry_topic(group)
        try:  # the broker copies the dead letter (clients cannot send to system topics)
            reply: SendBackReply = await self._call(SendBack(
                group, dlq_topic(group), 0, m.queue_offset, resend=True))
        except ConnectionLost:
            raise
        except OnceqError as exc:
            res.error = f"{exc.code.name}: {exc.message}"
            return res
        if reply.queue is None or reply.offset is None:
            res.error = "the broker did not say where the message went"
            return res
        res.queue_id, res.offset, res.duplicate = reply.queue, reply.offset, reply.duplicate
        return res


def _fields(reply: Message) -> dict[str, Any]:
    """A reply's fields as a map (what the admin calls that answer a map return)."""
    return {s.name: getattr(reply, s.name) for s in reply.SPECS}
