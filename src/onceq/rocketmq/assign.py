"""Queue-owning consumption for RocketMQ's PushConsumer: ``QueryAssignment`` answered by
onceq's allocation, receives under onceq's transition-state access lock.

* **Members**: a PushConsumer is a member of its group in onceq's registry (its client
  id, ``CLUSTERING``, the access lock on), registered by its Telemetry settings, its
  heartbeats, its assignment queries and its receives; it leaves at
  ``NotifyClientTermination``, when its Telemetry stream ends for good (a killed process),
  or when its heartbeats stop for ``heartbeat_expiry_s``.
* **Allocation**: the group's PushConsumers subscribed to the topic, sorted by client id,
  share the topic's queues in contiguous blocks (onceq's ``allocate_average``); the
  answer to ``QueryAssignment`` is the asking member's share.
* **Receives**: a receive names one queue. It is served only while the queue is assigned
  to the member, and through onceq's ``PULL`` with the group and the client id, so the
  access lock decides: a queue is handed to its new member only once the previous one
  released it (below) or its lock went (the member left, or was not seen for
  ``access_lock_hold_s``). Meanwhile the receive waits (woken by the release), as a
  refused pull of onceq's own consumer retries.
* **Sessions**: per (member, queue) the front end keeps what a push consumer's process
  queue holds: the next offset to pull and the deliveries in flight (``pop.py``). The
  member's acknowledgements move the group's offset to the lowest offset in flight,
  committed under its client id (only the holder's commits count); an acknowledgement
  above it is journaled (``journal.py``). A PushConsumer receives with ``auto_renew``:
  its deliveries stay invisible (``AUTO_RENEW_S``) while it holds the queue, and come
  back to it after a nack's back-off (``ChangeInvisibleDuration``).
* **Handover**: a queue no longer assigned to a member is served to it no more; once
  everything it received from the queue is acknowledged (or visible again; at the latest
  after ``DRAIN_S``, as onceq's own consumers bound their drain), the front end commits
  and releases the queue (``RELEASE_QUEUE``) for the member's, and the new
  member's waiting receive takes it at the committed offset: no message is delivered to
  two members. A member that leaves releases its queues at once at the lowest offset it
  left in flight (what it acknowledged above stays acknowledged).
* **FIFO groups** (``groups.py``): a member's receive of a queue hands out nothing while a
  delivery of the queue is in flight and invisible; it waits for the acknowledgement (or
  the dead-lettering, ``ForwardMessageToDeadLetterQueue``) and then serves the next
  messages, so a message group's messages reach the member one run at a time, in order.
  The queue is held under the access lock as any PushConsumer's, which also keeps it from
  a client holding onceq's orderly queue lock (``broker/ownership.py``); a queue taken
  from a member is released only once its deliveries are settled or visible again (no
  ``DRAIN_S`` bound), or the member left.
* **Dead letters**: a delivery visible again after the group's maximum of attempts goes to
  ``%DLQ%<group>`` instead (``PopService.again_or_dead``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._allocation import MessageQueue, allocate_average
from ..protocol.codes import PullStatus
from ..protocol.errors import OnceqError
from ..protocol.replies import OffsetReply, PullReply, QueueOffsets, TopicInfo
from ..protocol.requests import GetOffset, GetTopic, Pull, QueryOffsets, ReleaseQueue
from ._pb import definition_pb2 as pb
from .bridge import FrontConnection
from .consume import PopService, Receive, decode, take
from .journal import Key3
from .mapping import Code, RmqError
from .pop import PopTable, QueuePop, StaleReceipt
from .receipt import Receipt

if TYPE_CHECKING:
    from ..broker.groups import GroupRegistry

log = logging.getLogger("onceq.rocketmq")

PUSH = "PUSH_CONSUMER"  # the member's ``rocketmq`` meta
AUTO_RENEW_S = 1800.0  # invisible duration of a delivery the holder renews
LOCK_RETRY_S = 0.2  # a receive refused by the access lock tries again after this
DRAIN_S = 10.0  # a queue taken from a member is released at the latest this long after


class QueueConsumers:
    """Assignments, receives, acknowledgements of the PushConsumers of every group."""

    def __init__(self, pop: PopService, registry: GroupRegistry,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pop = pop
        self.bridge = pop.bridge
        self.registry = registry
        self.clock = clock
        self.conn = FrontConnection("rocketmq-push")
        self.tables: dict[str, PopTable] = {}  # client id -> its sessions
        self._released: dict[Key3, asyncio.Event] = {}
        self._revoked: dict[tuple[str, Key3], float] = {}  # since when, per session
        self.handovers = 0  # queues released by one member for another

    # ---------------------------------------------------------------- allocation
    def members(self, group: str, topic: str) -> list[str]:
        return [m.client_id for m in self.registry.members(group)
                if m.meta.get("rocketmq") == PUSH and topic in m.subscriptions]

    def assigned(self, group: str, topic: str, queues: int, client: str,
                 members: list[str] | None = None) -> list[int]:
        """The queues of ``topic`` onceq's allocation gives ``client`` in ``group``
        (``members``: the group's, when the caller has them)."""
        if members is None:
            members = self.members(group, topic)
        if client not in members:
            return []
        mqs = [MessageQueue(topic, q) for q in range(queues)]
        return [mq.queue_id for mq in allocate_average(client, mqs, members)]

    async def queues_of(self, topic: str) -> int:
        info = await self.bridge.call(self.conn, GetTopic(topic))
        assert isinstance(info, TopicInfo)
        return info.queues

    # ---------------------------------------------------------------- receive
    async def receive(self, r: Receive, client: str, queue: int,
                      queues: int | None = None) -> list[pb.Message]:
        """Up to ``r.batch`` messages of ``queue``, while it is assigned to ``client`` and
        the access lock lets it pull; waits up to ``r.wait_s`` otherwise. ``queues``: the
        topic's queue count, when the caller has it."""
        if queues is None:
            queues = await self.queues_of(r.topic)
        if not 0 <= queue < queues:
            raise RmqError(Code.BAD_REQUEST, f"topic {r.topic} has no queue {queue}")
        key = (r.group, r.topic, queue)
        deadline = self.clock() + r.wait_s
        while True:
            await self.release_revoked(r.group, r.topic, queues)
            out: list[pb.Message] = []
            locked = True
            if queue in self.assigned(r.group, r.topic, queues, client):
                locked = not await self._serve(r, client, key, queues, out,
                                               deadline - self.clock())
                if out:
                    return out
            left = deadline - self.clock()
            if left <= 0:
                return out
            if locked:  # not ours (yet): woken by a release, or tried again
                ev = self._released.get(key)
                if ev is None:
                    ev = self._released[key] = asyncio.Event()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ev.wait(), min(left, LOCK_RETRY_S))

    async def _session(self, client: str, key: Key3) -> tuple[PopTable, QueuePop, bool]:
        """The member's session of the queue: (its table, the queue, whether it is new).
        A new one starts at the group's committed offset (the queue's first without)."""
        table = self.tables.get(client)
        if table is None:
            table = self.tables[client] = PopTable(generations=self.pop.generation)
        q = table.queue(*key)
        if q is not None:
            return table, q, False
        stored = await self.bridge.call(self.conn, GetOffset(*key))
        assert isinstance(stored, OffsetReply)
        bounds = await self.bridge.call(self.conn, QueryOffsets(key[1], key[2]))
        assert isinstance(bounds, QueueOffsets)
        q = table.queue(*key)  # another receive may have started it meanwhile
        if q is not None:
            return table, q, False
        self.pop.placed(key, stored.offset, reset=False)
        return table, table.start(*key, stored.offset, bounds.min), True

    async def _pull(self, conn: FrontConnection, req: Pull, wait: float) -> PullReply | None:
        """A pull under the access lock; held up to ``wait`` seconds when empty."""
        reply, corr, fut = self.bridge.submit(conn, req)
        if reply is None:
            try:
                reply = await asyncio.wait_for(fut, wait + 1.0)
            except TimeoutError:
                return None
            finally:
                conn.forget(corr)
        assert isinstance(reply, PullReply)
        return reply

    async def _serve(self, r: Receive, client: str, key: Key3, queues: int,
                     out: list[pb.Message], wait: float) -> bool:
        """Serve one receive from the member's session; False when the access lock
        refused the pull (a new session is then dropped, a held one is lost)."""
        group, topic, queue = key
        fifo = self.pop.settings(group).fifo
        ev = self.pop.event(group, topic)  # taken before looking: no wake-up is missed
        table, q, fresh = await self._session(client, key)
        conn = FrontConnection("rocketmq-push-receive")
        try:
            for qid, offset in table.due(group, topic, self.clock(), fifo):
                if qid != queue or len(out) >= r.batch:
                    continue
                if not table.still_due(group, topic, qid, offset, self.clock()):
                    continue
                if not await self.pop.again_or_dead(table, r, qid, offset, client):
                    continue
                reply = await self._pull(conn, Pull(topic, queue, offset, 1, group=group,
                                                    client=client), 0)
                if reply is None or reply.status == PullStatus.LOCKED:
                    return self._lost(client, key, table, fresh)
                # afresh: acknowledged, changed or delivered again while the pull waited
                if not table.still_due(group, topic, qid, offset, self.clock()):
                    continue
                msgs = decode(reply, offset, offset + 1, None) if reply.payload else []
                if msgs:
                    out.append(self.pop.deliver(table, r, msgs[0]))
                else:  # gone (retention, damage): settled
                    table.drop(group, topic, queue, offset)
            if len(out) >= r.batch:
                return True
            if fifo and q.inflight:  # a FIFO queue waits for what it handed out
                if not out:
                    await self._blocked(table, key, ev, wait)
                return True
            start = q.next
            hold = 0 if out or fresh else max(min(wait, self.pop.bridge.broker.config
                                                  .long_poll_max_s), 0.0)
            reply = await self._pull(conn, Pull(
                topic, queue, start, r.batch - len(out), tags=r.tags, group=group,
                client=client, suspend_ms=int(hold * 1000)), hold)
        finally:
            self.bridge.broker.holds.drop_connection(conn)
            conn.close()
        if reply is None:
            return True
        if reply.status == PullStatus.LOCKED:
            return self._lost(client, key, table, fresh)
        if table.queue(*key) is not q:  # dropped meanwhile (released, lost)
            return True
        if reply.status in (PullStatus.OFFSET_MOVED, PullStatus.DAMAGED):
            q.next = max(q.next, reply.next)
        elif reply.status == PullStatus.NO_NEW_MESSAGE:
            if q.next == start:
                q.next = max(q.next, reply.next)  # the filter passed over these
        elif (reply.status == PullStatus.FOUND and reply.payload
              and not (fifo and q.inflight)  # another receive handed out meanwhile
              and queue in self.assigned(group, topic, queues, client)):  # still ours
            take(self.pop, r, q, reply, out, lambda rr, m: self.pop.deliver(table, rr, m))
        return True

    async def _blocked(self, table: PopTable, key: Key3, ev: asyncio.Event, wait: float
                       ) -> None:
        """Wait until a delivery of the group is settled (or changed), the queue's next
        delivery becomes visible again, or ``wait`` passes."""
        q = table.queue(*key)
        now = self.clock()
        if q is not None and q.inflight:
            times = [d.visible_at for d in q.inflight.values() if not d.settling]
            if times:
                wait = min(wait, max(min(times) - now, 0.0) + 0.01)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ev.wait(), max(wait, 0.0))

    def _lost(self, client: str, key: Key3, table: PopTable, fresh: bool) -> bool:
        """The access lock refused the member's pull: a new session is dropped; a held
        one was taken from it (it was not seen for the lock's hold): its handles are
        stale, its messages are delivered again by the new holder."""
        if not fresh:
            log.info("push consumer %s lost %s:%d of group %s (access lock)", client,
                     key[1], key[2], key[0])
        table.forget_queue(*key)
        return False

    # ---------------------------------------------------------------- handover
    async def release_revoked(self, group: str, topic: str, queues: int) -> None:
        """Release the queues of ``topic`` no longer assigned to the member holding them,
        once everything it received from them is acknowledged or visible again (at once
        for a member that is gone)."""
        now = self.clock()
        listed = self.members(group, topic)
        members = set(listed)
        for client, table in list(self.tables.items()):
            sessions = table.queues(group, topic)
            if not sessions:
                continue
            mine = set(self.assigned(group, topic, queues, client, listed))
            for queue, q in sessions.items():
                key = (group, topic, queue)
                if queue in mine and client in members:
                    self._revoked.pop((client, key), None)
                    continue
                since = self._revoked.setdefault((client, key), now)
                # a FIFO group's queue waits for its deliveries without the bound: the
                # next member must not consume a message group while this one still does
                drained = now - since >= DRAIN_S and not self.pop.settings(group).fifo
                if (client not in members or drained
                        or all(d.due(now) for d in q.inflight.values())):
                    await self._release(client, key, table, q)

    async def _release(self, client: str, key: Key3, table: PopTable, q: QueuePop) -> None:
        if table.queue(*key) is not q:
            return
        table.forget_queue(*key)
        self._revoked.pop((client, key), None)
        point = q.commit_point()
        try:
            await self.bridge.call(self.conn, ReleaseQueue(
                key[0], client, key[1], key[2], point if point >= 0 else None))
        except OnceqError as exc:
            log.warning("release of %s:%d of group %s by %s: %s", key[1], key[2], key[0],
                        client, exc)
        if self.pop.journal is not None:
            self.pop.journal.prune(key, point)
        self.handovers += 1
        log.info("push consumer %s released %s:%d of group %s at %d (%d in flight)",
                 client, key[1], key[2], key[0], point, len(q.inflight))
        released = self._released.pop(key, None)
        if released is not None:
            released.set()

    async def gone(self, client: str) -> None:
        """The member left: every queue it holds is released now."""
        table = self.tables.pop(client, None)
        if table is None:
            return
        for group, topic in table.topics():
            for queue, q in table.queues(group, topic).items():
                await self._release(client, (group, topic, queue), table, q)

    # ---------------------------------------------------------------- ack, change
    def _find(self, client: str, rc: Receipt) -> tuple[str, PopTable] | None:
        """The session a delivery is in flight in (the acknowledging member's first)."""
        order = [client, *[c for c in self.tables if c != client]]
        for cid in order:
            table = self.tables.get(cid)
            q = None if table is None else table.queue(rc.group, rc.topic, rc.queue)
            if q is not None and rc.offset in q.inflight:
                assert table is not None
                return cid, table
        return None

    def _in_flight(self, client: str, rc: Receipt) -> QueuePop | None:
        """The session queue the delivery ``rc`` names is in flight in now (None)."""
        found = self._find(client, rc)
        return None if found is None else found[1].queue(rc.group, rc.topic, rc.queue)

    async def ack(self, client: str, group: str, topic: str, handle: str) -> None:
        rc = self.pop.receipt(group, topic, handle)
        key = (group, topic, rc.queue)
        if await self.pop.ack_earlier(rc, lambda: self._in_flight(client, rc), client):
            return
        found = self._find(client, rc)
        if found is None:
            raise RmqError(Code.INVALID_RECEIPT_HANDLE, f"message {topic}:{rc.queue}:"
                           f"{rc.offset} of group {group} is not in flight: acknowledged "
                           "already, or its queue went to another member (it is delivered "
                           "again from the group's offset)")
        holder, table = found
        try:
            q = table.ack(group, topic, rc.queue, rc.offset, rc.generation)
        except StaleReceipt as exc:
            raise RmqError(Code.INVALID_RECEIPT_HANDLE, str(exc)) from None
        await self.pop.settle(key, q, rc.offset, holder)
        if not q.inflight:
            await self.release_revoked(group, topic, await self.queues_of(topic))

    def change(self, client: str, group: str, topic: str, handle: str, invisible_s: float
               ) -> str:
        rc = self.pop.receipt(group, topic, handle)
        found = self._find(client, rc)
        if found is None:
            raise RmqError(Code.INVALID_RECEIPT_HANDLE, f"message {topic}:{rc.queue}:"
                           f"{rc.offset} of group {group} is not in flight")
        try:
            d = found[1].change(group, topic, rc.queue, rc.offset, rc.generation,
                                invisible_s, self.clock())
        except StaleReceipt as exc:
            raise RmqError(Code.INVALID_RECEIPT_HANDLE, str(exc)) from None
        self.pop.wake(group, topic)
        return self.pop.codec.encode(Receipt(group, topic, rc.queue, rc.offset,
                                             d.generation))

    async def forward(self, client: str, group: str, topic: str, handle: str, attempt: int,
                      limit: int) -> None:
        """``ForwardMessageToDeadLetterQueue``: the member gave up on the message (a FIFO
        PushConsumer after its local retries): to the dead-letter queue, acknowledged."""
        rc = self.pop.receipt(group, topic, handle)
        key = (group, topic, rc.queue)
        found = self._find(client, rc)
        if found is None and rc.generation >= self.pop.first_generation:
            raise RmqError(Code.INVALID_RECEIPT_HANDLE, f"message {topic}:{rc.queue}:"
                           f"{rc.offset} of group {group} is not in flight: acknowledged "
                           "already, or its queue went to another member")
        holder, table = found if found is not None else (client, PopTable())
        q = table.queue(*key)
        await self.pop.forward(table, rc, lambda: self._in_flight(client, rc), holder,
                               attempt, limit)
        if q is not None and not q.inflight:
            await self.release_revoked(group, topic, await self.queues_of(topic))
