"""The consumer group service: membership (``HEARTBEAT``, ``UNREGISTER``, member and group
lists, the ``GROUP_CHANGED`` push), the group's ack offsets (``COMMIT_OFFSET``, the
``RELEASE_QUEUE`` at the end of a drain, the admin's ``RESET_OFFSETS`` and
``DELETE_GROUP``).

The registry of members is ``groups.py``; who holds a queue and whose commits count is the
queue-ownership core (``ownership.py``, served by ``ownership_service.py``); a forced reset
is ``offset_reset.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import (
    Empty,
    GroupChanged,
    GroupDeletedReply,
    GroupList,
    GroupMembers,
    HeartbeatReply,
    Released,
    ResetReply,
)
from ..storage.store import check_name
from .fields import user_topic
from .groups import CLUSTERING
from .offset_reset import parse_targets, reset_offsets
from .ownership import Refusal

if TYPE_CHECKING:
    from ..protocol.requests import (
        CommitOffset,
        DeleteGroup,
        Heartbeat,
        ListGroupMembers,
        ListGroups,
        ReleaseQueue,
        ResetOffsets,
        Unregister,
    )
    from ..storage.store import MessageStore
    from .client_ids import ClientIds
    from .config import BrokerConfig
    from .connection import Connection
    from .durable import DurableReplies
    from .fields import Call
    from .groups import GroupRegistry
    from .ownership_service import OwnershipService
    from .pull import PullService
    from .retry import RetryService
    from .trace import DeliveryTrace

log = logging.getLogger("onceq.broker")

MAX_GROUPS = 10_000  # groups with members on one broker
MAX_GROUPS_PER_CLIENT = 64  # groups one client (one connection) is a member of


class ConsumerGroupService:
    """Members and ack offsets of consumer groups. ``retry`` is set when the broker starts,
    and ``started`` (when it started: the last sign of life of holders restored from
    before a restart)."""

    def __init__(self, config: BrokerConfig, store: MessageStore,
                 clock: Callable[[], float], *, groups: GroupRegistry,
                 owners: OwnershipService, pulls: PullService, trace: DeliveryTrace,
                 durable: DurableReplies, client_ids: ClientIds) -> None:
        self.config = config
        self.client_ids = client_ids
        self.store = store
        self.clock = clock
        self.groups = groups
        self.owners = owners
        self.pulls = pulls
        self.trace = trace
        self.durable = durable
        self.retry: RetryService | None = None
        self.started = clock()
        self.max_groups = MAX_GROUPS
        self.max_groups_per_client = MAX_GROUPS_PER_CLIENT
        # told of every membership change first (queue_scaler.py: topics following a group)
        self.on_members: Callable[[str], None] | None = None

    # ---------------------------------------------------------------- membership
    def h_heartbeat(self, call: Call, req: Heartbeat) -> HeartbeatReply:
        client, conn = req.client, call.conn
        if not 1 <= len(client) <= 255:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "client id must be 1-255 characters")
        # every field was checked when decoded; the names too before anything changes
        names = [check_name("group", g.group) for g in req.groups]
        now = self.clock()
        holds = []
        resets = []
        locked = False  # the access lock applies to this member in some group
        self._check_group_bounds(client, conn, names)
        for name, g in zip(names, req.groups, strict=True):
            self.groups.heartbeat(name, client, conn, g.model, g.subs, now, g.meta)
            # the queues the member holds (after a reconnect: restore the access lock),
            # and a forced reset it has not handled: repeated, its queues not re-taken
            applies, held_now, pending = self.owners.heartbeat(name, client, g.held,
                                                               g.reset_gen)
            locked = locked or applies
            holds += [[name, t, q, has] for t, q, has in held_now]
            if pending is not None:
                resets.append(pending)
        conn.client_ids.add(client)
        self.client_ids.bind(conn, client)  # checked before (Broker.dispatch)
        self.owners.touch_client(client)
        # a holder not seen for hold_s may lose its queues (the client's lease)
        return HeartbeatReply(self.config.heartbeat_expiry_s, holds,
                              self.config.access_lock_hold_s if locked else None,
                              resets or None)

    def _check_group_bounds(self, client: str, conn: Connection, names: list[str]) -> None:
        """A client is a member of at most ``max_groups_per_client`` groups, and the broker
        keeps at most ``max_groups`` groups with members: beyond, a heartbeat that would add
        one is refused (``TOO_MANY_GROUPS``) and changes nothing."""
        registry = self.groups.groups
        if all(client in registry.get(g, ()) for g in names):
            return  # the steady state: no group joined, nothing to count
        mine = {g for g, members in registry.items()
                if (m := members.get(client)) is not None and m.conn is conn}
        wanted = mine | set(names)
        if len(wanted) > self.max_groups_per_client:
            raise OnceqError(ErrorCode.TOO_MANY_GROUPS, f"a client may be a member of at most "
                             f"{self.max_groups_per_client} groups ({len(wanted)} asked)")
        new = sum(1 for g in set(names) if not registry.get(g))
        if new and len(registry) + new > self.max_groups:
            raise OnceqError(ErrorCode.TOO_MANY_GROUPS, f"the broker keeps at most "
                             f"{self.max_groups} groups with members")

    def retry_topic_created(self, group: str) -> None:
        """The group's first send-back created its retry topic: its members rebalance to
        consume it (a retry is due after its delay level, the rebalance comes at once)."""
        for m in self.groups.members(group):
            m.conn.push(GroupChanged(group, "", "retry topic"))

    def h_unregister(self, call: Call, req: Unregister) -> Empty:
        group = check_name("group", req.group)
        self.groups.unregister(group, req.client, "leave")
        self.owners.unregistered(group, req.client)
        return Empty()

    def h_list_members(self, call: Call, req: ListGroupMembers) -> GroupMembers:
        group = check_name("group", req.group)
        if group not in self.groups.groups and group not in self.store.offsets.groups:
            raise OnceqError(ErrorCode.GROUP_NOT_EXIST, f"consumer group {group!r} is unknown")
        members = [
            {"client": m.client_id, "model": m.model, "subs": m.subscriptions,
             "last_heartbeat_ms": int(m.last_heartbeat * 1000), "peer": m.conn.peer}
            for m in self.groups.members(group)
        ]
        known = {m["client"] for m in members}
        members += [  # holders saved before a restart, not reconnected yet
            {"client": cid, "model": CLUSTERING, "subs": {}, "peer": "(restored)",
             "last_heartbeat_ms": int(self.started * 1000), "restored": True}
            for cid in self.restored_members(group) if cid not in known]
        return GroupMembers(group, members)

    def restored_members(self, group: str) -> list[str]:
        """Holders of access or orderly locks saved before a restart, not back yet."""
        return self.owners.restored_members(group)

    def h_list_groups(self, call: Call, req: ListGroups) -> GroupList:
        return GroupList(sorted(set(self.groups.groups) | set(self.store.offsets.groups)))

    def on_group_change(self, group: str, client_id: str, reason: str) -> None:
        """A member joined, changed or left: drop its locks when it left, tell the group."""
        log.info("group %s: %s %s", group, client_id, reason)
        self.trace.member(group, client_id, reason)
        if reason in ("leave", "disconnect", "expired"):
            self.owners.member_gone(group, client_id, reason)
        if self.on_members is not None:
            self.on_members(group)
        for m in self.groups.members(group):
            m.conn.push(GroupChanged(group, client_id, reason))

    # ---------------------------------------------------------------- ack offsets
    def h_commit_offset(self, call: Call, req: CommitOffset) -> Empty | None:
        offset, client = req.offset, req.client
        if offset < 0:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "offset must be >= 0")
        group = check_name("group", req.group)
        topic, queue = user_topic(req.topic), req.queue
        self.store.min_max(topic, queue)  # TOPIC_NOT_EXIST / INVALID_QUEUE first
        self.owners.seen(group, client, req.reset_gen)
        v, end = self.owners.commit(group, client, topic, queue, offset)
        if v.refused is Refusal.FENCED:
            raise OnceqError(ErrorCode.NOT_HOLDER, (
                f"the offsets of group {group!r} on {topic}:{queue} were reset; client "
                f"{client!r} must take the queue again first"))
        if v.refused is Refusal.NOT_HOLDER:
            holder = self.owners.holder(group, topic, queue)
            raise OnceqError(ErrorCode.NOT_HOLDER, (
                f"client {client!r} does not hold {topic}:{queue} of group {group!r} "
                f"(holder: {holder or 'none'}); only the holder's commits count"))
        if v.refused is Refusal.PAST_END:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, (
                f"offset {offset} is past the end of {topic}:{queue} "
                f"({self.store.min_max(topic, queue)[1]})"))
        if v.refused is Refusal.BEHIND:
            raise OnceqError(ErrorCode.OFFSET_BEHIND, (
                f"offset {offset} of group {group!r} on {topic}:{queue} is below its "
                f"committed offset {v.stored}; offsets move back only by a reset "
                f"(onceq offsets reset)"))
        return self.durable.reply(call, Empty(), end=end)

    def h_release_queue(self, call: Call, req: ReleaseQueue) -> Released | None:
        """End of a drain: commit the final offset, drop held pulls, release the lock."""
        group = check_name("group", req.group)
        client, topic, queue = req.client, req.topic, req.queue
        if topic not in self.store.topics:  # deleted meanwhile: nothing left to release
            return Released(False)
        self.pulls.give_up(client=client, topic=topic, queue=queue)
        self.owners.seen(group, client, req.reset_gen)
        # a client that never got the queue must not move its offset under the one still
        # draining it; a lower offset than the stored one is a stale start, not progress
        released, end = self.owners.release(group, client, topic, queue, req.offset)
        return self.durable.reply(call, Released(released), end=end)

    def h_reset_offsets(self, call: Call, req: ResetOffsets) -> ResetReply | None:
        """Admin: move a group's offsets on a topic (see ``offset_reset.py``)."""
        group = check_name("group", req.group)
        topic = user_topic(req.topic)
        targets = parse_targets(req.offsets, self.store.get_topic(topic).queues)
        reply, end = reset_offsets(self.store, self.groups, self.owners, self.pulls.wake,
                                   group=group, topic=topic, targets=targets, force=req.force,
                                   restored=self.restored_members(group))
        return self.durable.reply(call, reply, end=end)

    def h_delete_group(self, call: Call, req: DeleteGroup) -> GroupDeletedReply | None:
        """Admin: forget a group's committed offsets (as Kafka's ``--delete`` of a group):
        refused with ``GROUP_ACTIVE`` while it has live members (or holders restored from
        before a restart), ``GROUP_NOT_EXIST`` for a group the broker does not know. Its
        retry and dead-letter topics stay (topics of their own). Answered once durable."""
        group = check_name("group", req.group)
        members = [m.client_id for m in self.groups.members(group)]
        members += [c for c in self.restored_members(group) if c not in members]
        if members:
            raise OnceqError(ErrorCode.GROUP_ACTIVE, (
                f"group {group!r} has {len(members)} live member(s) "
                f"({', '.join(members[:5])}{', ...' if len(members) > 5 else ''}): stop them "
                "first"))
        if group not in self.store.offsets.groups:
            raise OnceqError(ErrorCode.GROUP_NOT_EXIST, f"consumer group {group!r} is unknown")
        queues, end = self.store.delete_group(group)
        log.info("group %s deleted: %d committed offset(s) forgotten", group, queues)
        return self.durable.reply(call, GroupDeletedReply(group, queues), end=end)
