"""POP consumption for RocketMQ's SimpleConsumer (and PushConsumer in POP mode): receive
with an invisible duration, acknowledge by receipt handle, change the invisible duration.

Everything reaches the store through the broker's services with onceq's typed requests
(``bridge.py``): ``PULL`` reads (without a group: the front end keeps the group's
in-flight state itself, ``pop.py``), ``GET_OFFSET`` and ``QUERY_OFFSETS`` place a
queue's cursor, ``COMMIT_OFFSET`` moves the group's committed offset under the commit
rule (forward only) once the messages below it are acknowledged. A receive waits for
messages as onceq's long polling does: one held pull per queue of the topic, woken by a
send; it also wakes when a delivery in flight becomes visible again.

A receive serves any queue of the topic on this broker (as RocketMQ's POP does), whatever
queue of the route the client named.

Per group (``groups.py``): a FIFO group takes a queue's messages only while nothing of the
queue is invisible (``pop.py``), and a waiting receive also wakes when a delivery is
acknowledged; a message delivered the group's maximum of times and still not acknowledged
goes to ``%DLQ%<group>`` (onceq's ``SEND_BACK`` to the dead-letter queue, the same copy
onceq's own consumers make) instead of being delivered again, and counts as acknowledged.
``ForwardMessageToDeadLetterQueue`` (a FIFO PushConsumer giving up on a message after its
local retries) does the same at once.

Acknowledgements, changes and forwards await the broker (``GetOffset``, ``SEND_BACK``, the
journal) while receives of the group go on: whatever they checked before an await is read
again after it. A receipt handle of before a restart is refused once its message was
delivered again, also when that delivery is made while the acknowledgement waits; a delivery
being moved to the dead-letter queue is held (``Delivery.settling``) until the move is
stored, so that no receive delivers it again meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..log.message import MessageExt
from ..log.record import RecordError, decode_records, tag_hash
from ..protocol.codes import MAX_DLQ_REASON, PullStatus
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import OffsetReply, PullReply, QueueOffsets, TopicInfo
from ..protocol.requests import CommitOffset, GetOffset, GetTopic, Pull, QueryOffsets, SendBack
from ._pb import definition_pb2 as pb
from .bridge import Bridge, FrontConnection
from .groups import DEFAULT, GroupSettings
from .journal import Key3, PopJournal
from .mapping import Code, RmqError, to_pb
from .pop import Delivery, PopTable, QueuePop, StaleReceipt
from .receipt import BadReceipt, Receipt, ReceiptCodec

log = logging.getLogger("onceq.rocketmq")

MAX_INVISIBLE_S = 12 * 3600.0  # RocketMQ's longest invisible duration


@dataclass(slots=True)
class Receive:
    """One ReceiveMessage: what it asks for."""

    group: str
    topic: str
    tags: list[str] | None  # None: every message
    batch: int
    invisible_s: float
    wait_s: float  # long polling: how long an empty receive may wait
    namespace: str = ""


def check_invisible(seconds: float) -> float:
    if not 0 < seconds <= MAX_INVISIBLE_S:
        raise RmqError(Code.ILLEGAL_INVISIBLE_TIME, f"invisible duration {seconds:g}s must "
                       f"be above 0 and at most {MAX_INVISIBLE_S:g}s")
    return seconds


class PopService:
    """Receives, acknowledgements and invisible-duration changes of RocketMQ consumers."""

    def __init__(self, bridge: Bridge, codec: ReceiptCodec, *, store_host: str,
                 journal: PopJournal | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 groups: Callable[[str], GroupSettings] | None = None) -> None:
        self.bridge = bridge
        self.settings = groups or (lambda group: DEFAULT)  # a group's (groups.py)
        self.dead_letters = 0  # messages this front end moved to a dead-letter queue
        self._events: dict[tuple[str, str], asyncio.Event] = {}
        self.codec = codec
        self.store_host = store_host
        self.clock = clock
        self.journal = journal
        self._gen = journal.first_generation if journal is not None else 1
        self.table = PopTable(generations=self.generation)
        self.conn = FrontConnection("rocketmq-pop")  # its own immediate requests
        self._rotate = itertools.count()

    def generation(self) -> int:
        """The next delivery generation (unique across restarts with a journal)."""
        g = self._gen
        self._gen += 1
        if self.journal is not None:
            self.journal.reserve(g)
        return g

    def is_acked(self, key: Key3, offset: int) -> bool:
        return self.journal is not None and self.journal.is_acked(key, offset)

    def placed(self, key: Key3, committed: int, *, reset: bool) -> None:
        """A queue's state (re)starts at the group's committed offset: acknowledgements it
        covers are dropped; all are after an offsets reset."""
        if self.journal is not None:
            if reset:
                self.journal.forget(key)
            else:
                self.journal.prune(key, committed)

    async def settle(self, key: Key3, q: QueuePop, offset: int, client: str | None) -> None:
        """``offset`` was acknowledged (it left ``q.inflight``): the group's offset moves
        to the queue's commit point when that covers it; otherwise the acknowledgement is
        journaled, so that a restart does not deliver the message again."""
        covered = False
        if q.commit_point() > offset:
            try:
                await self.commit(key, q, client)
                covered = True
            except OnceqError as exc:  # not the holder any more, a reset: keep the ack
                log.debug("commit of %s by %s refused: %s", key, client, exc)
        if not covered and self.journal is not None:
            await self.journal.ack(key, offset)
        self.wake(key[0], key[1])

    # ---------------------------------------------------------------- wake-ups
    def event(self, group: str, topic: str) -> asyncio.Event:
        """Set at the next acknowledgement (or invisible-duration change) of the group's
        messages of ``topic``: a FIFO queue may hand out again. Take it before looking."""
        ev = self._events.get((group, topic))
        if ev is None:
            ev = self._events[(group, topic)] = asyncio.Event()
        return ev

    def wake(self, group: str, topic: str) -> None:
        ev = self._events.pop((group, topic), None)
        if ev is not None:
            ev.set()

    # ---------------------------------------------------------------- dead letters
    async def dead_letter(self, table: PopTable, key: Key3, offset: int,
                          client: str | None, reason: str) -> None:
        """Move the message at ``offset`` (in flight in ``table``) to the group's
        dead-letter queue; it then counts as acknowledged. Its delivery is held while the
        move is stored (``settling``: not delivered again, its handle settles nothing) and
        released as it was when the move fails."""
        q = table.queue(*key)
        d = None if q is None else q.inflight.get(offset)
        if d is None or d.settling:
            return  # settled already, or being moved by another request
        d.settling = True
        try:
            await self._to_dlq(key, offset, reason)
        finally:
            d.settling = False
        q = table.queue(*key)  # afresh: the queue may have restarted meanwhile (a reset)
        if q is None or q.inflight.get(offset) is not d:
            return
        del q.inflight[offset]
        await self.settle(key, q, offset, client)

    async def _to_dlq(self, key: Key3, offset: int, reason: str) -> None:
        group, topic, queue = key
        try:
            await self.bridge.call(self.conn, SendBack(group, topic, queue, offset, -1,
                                                       dlq_reason=reason[:MAX_DLQ_REASON]))
        except OnceqError as exc:
            if exc.code != ErrorCode.INVALID_ARGUMENT:
                raise  # e.g. a full disk: still in flight, tried again later
            log.warning("dead letter of %s:%d:%d of group %s: %s (gone)", topic, queue,
                        offset, group, exc)
            return
        self.dead_letters += 1
        log.info("message %s:%d:%d of group %s moved to its dead-letter queue: %s", topic,
                 queue, offset, group, reason)

    async def again_or_dead(self, table: PopTable, r: Receive, queue: int, offset: int,
                            client: str | None) -> bool:
        """A delivery visible again: True when it is to be delivered again; False when its
        attempts are used up (it went to the dead-letter queue)."""
        attempts = table.attempt(r.group, r.topic, queue, offset)
        limit = self.settings(r.group).max_attempts
        if attempts < limit:
            return True
        await self.dead_letter(table, (r.group, r.topic, queue), offset, client,
                               f"not acknowledged after {attempts} deliveries to RocketMQ "
                               f"consumers (max delivery attempts {limit})")
        return False

    async def forward(self, table: PopTable, rc: Receipt,
                      inflight: Callable[[], QueuePop | None], client: str | None,
                      attempt: int, limit: int) -> None:
        """``ForwardMessageToDeadLetterQueue`` of the delivery ``rc`` names (in flight in
        ``table`` unless it is of before a restart; ``inflight`` as for ``ack_earlier``)."""
        reason = (f"forwarded to the dead-letter queue by the RocketMQ consumer after "
                  f"{attempt} attempts (max {limit})")
        if await self.ack_earlier(rc, inflight, client, dead_letter=reason):
            return
        try:
            table.current(rc.group, rc.topic, rc.queue, rc.offset, rc.generation)
        except StaleReceipt as exc:
            raise RmqError(Code.INVALID_RECEIPT_HANDLE, str(exc)) from None
        await self.dead_letter(table, (rc.group, rc.topic, rc.queue), rc.offset, client,
                               reason)

    async def commit(self, key: Key3, q: QueuePop, client: str | None) -> None:
        """Commit the queue's commit point (forward only) under ``client``."""
        point = q.commit_point()
        if point <= q.committed:
            return
        q.committed = point
        try:
            await self.bridge.call(self.conn, CommitOffset(*key, point, client=client))
        except OnceqError:  # e.g. moved by a reset meanwhile: the next receive restarts
            q.committed = -2  # the queue from the stored offset
            raise
        if self.journal is not None:
            self.journal.prune(key, point)

    # ---------------------------------------------------------------- cursors
    async def _queue(self, group: str, topic: str, queue: int) -> QueuePop:
        """The queue's POP state, (re)started at the group's committed offset when this
        table has none or the offset was moved under it (``onceq offsets reset``)."""
        call = self.bridge.call
        stored = await call(self.conn, GetOffset(group, topic, queue))
        assert isinstance(stored, OffsetReply)
        q = self.table.queue(group, topic, queue)
        if q is None or stored.offset != q.committed:
            bounds = await call(self.conn, QueryOffsets(topic, queue))
            assert isinstance(bounds, QueueOffsets)
            q = self.table.queue(group, topic, queue)  # another receive may have placed it
            if q is None or stored.offset != q.committed:
                self.placed((group, topic, queue), stored.offset,
                            reset=q is not None and 0 <= stored.offset < q.committed)
                q = self.table.start(group, topic, queue, stored.offset, bounds.min)
        return q

    # ---------------------------------------------------------------- receive
    async def receive(self, r: Receive) -> list[pb.Message]:
        """Up to ``r.batch`` messages: deliveries visible again first, then new ones;
        waits up to ``r.wait_s`` when there are none."""
        check_invisible(r.invisible_s)
        info = await self.bridge.call(self.conn, GetTopic(r.topic))
        assert isinstance(info, TopicInfo)
        deadline = self.clock() + r.wait_s
        out: list[pb.Message] = []
        fifo = self.settings(r.group).fifo
        while True:
            ev = self.event(r.group, r.topic)
            await self._again(r, out, fifo)
            await self._fresh(r, info.queues, out, fifo)
            left = deadline - self.clock()
            if out or left <= 0:
                return out
            due = self.table.next_visible(r.group, r.topic)
            if due is not None:
                left = min(left, max(due - self.clock(), 0.0) + 0.01)
            await self._wait(r, info.queues, left, out, fifo, ev)
            if out:
                return out

    async def _again(self, r: Receive, out: list[pb.Message], fifo: bool) -> None:
        """Deliver again the messages whose invisible duration ran out (those out of
        attempts go to the dead-letter queue)."""
        mine: set[int] = set()  # FIFO queues this receive delivers again from
        for queue, offset in self.table.due(r.group, r.topic, self.clock(), fifo):
            if len(out) >= r.batch:
                return
            if not self.table.still_due(r.group, r.topic, queue, offset, self.clock()):
                continue  # delivered again meanwhile by another receive
            q = self.table.queue(r.group, r.topic, queue)
            if fifo and queue not in mine and q is not None and q.blocked(self.clock()):
                continue  # another receive delivers this FIFO queue again
            mine.add(queue)
            if not await self.again_or_dead(self.table, r, queue, offset, None):
                continue
            reply = await self.bridge.call(self.conn, Pull(r.topic, queue, offset, 1))
            assert isinstance(reply, PullReply)
            if not self.table.still_due(r.group, r.topic, queue, offset, self.clock()):
                continue
            msgs = decode(reply, offset, offset + 1, None) if reply.payload else []
            if not msgs:  # gone (retention, damage): nobody can have it any more
                self.table.drop(r.group, r.topic, queue, offset)
                await self._commit(r.group, r.topic, queue)
                continue
            out.append(self._deliver(r, msgs[0]))

    async def _fresh(self, r: Receive, queues: int, out: list[pb.Message], fifo: bool
                     ) -> None:
        """New messages from each queue's cursor (not waiting), starting at a rotating
        queue so that no queue starves the others; a FIFO group's only from queues with
        nothing in flight."""
        first = next(self._rotate)
        for i in range(queues):
            if len(out) >= r.batch:
                return
            queue = (first + i) % queues
            q = await self._queue(r.group, r.topic, queue)
            if q.full or (fifo and q.inflight):
                continue
            start = q.next
            reply = await self.bridge.call(self.conn, Pull(
                r.topic, queue, start, r.batch - len(out), tags=r.tags))
            assert isinstance(reply, PullReply)
            self._accept(r, queue, start, reply, out, fifo)

    async def _wait(self, r: Receive, queues: int, seconds: float,
                    out: list[pb.Message], fifo: bool, ev: asyncio.Event) -> None:
        """Hold one pull per queue at its cursor until a message comes, ``ev`` is set (an
        acknowledgement: a FIFO queue may hand out again) or ``seconds`` pass; the
        messages of the pulls answered are taken."""
        conn = FrontConnection("rocketmq-receive")  # its held pulls are dropped together
        waits: dict[asyncio.Future[object], tuple[int, int]] = {}
        ms = max(int(seconds * 1000), 1)
        try:
            for queue in range(queues):
                q = await self._queue(r.group, r.topic, queue)
                if q.full or (fifo and q.inflight):
                    continue
                start = q.next
                reply, corr, fut = self.bridge.submit(conn, Pull(
                    r.topic, queue, start, r.batch, tags=r.tags, suspend_ms=ms))
                if reply is not None:  # answered at once (a message came meanwhile)
                    conn.forget(corr)
                    assert isinstance(reply, PullReply)
                    self._accept(r, queue, start, reply, out, fifo)
                else:
                    waits[fut] = (queue, start)  # type: ignore[index]
            if out:
                return
            # a FIFO group's receive also wakes at an acknowledgement (a queue may hand
            # out again); another group's only at a message or a delivery visible again
            woken = [asyncio.ensure_future(ev.wait())] if fifo else []
            try:
                if waits or woken:
                    await asyncio.wait([*waits, *woken],
                                       timeout=seconds + (1.0 if waits else 0),
                                       return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.sleep(seconds)
            finally:
                for w in woken:
                    w.cancel()
        finally:
            self.bridge.broker.holds.drop_connection(conn)
            conn.close()
        for fut, (queue, start) in waits.items():
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                reply = fut.result()
                assert isinstance(reply, PullReply)
                self._accept(r, queue, start, reply, out, fifo)

    def _accept(self, r: Receive, queue: int, start: int, reply: PullReply,
                out: list[pb.Message], fifo: bool = False) -> None:
        """Take the messages a pull from ``start`` found, from the queue's cursor on (a
        concurrent receive may have taken some), up to the batch; move the cursor past
        what was taken and what the filter passed over. A FIFO queue another receive
        handed out from meanwhile gives nothing."""
        q = self.table.queue(r.group, r.topic, queue)
        if q is None or q.next < start:  # restarted meanwhile (an offsets reset)
            return
        if fifo and q.inflight:
            return
        if reply.status in (PullStatus.OFFSET_MOVED, PullStatus.DAMAGED):
            q.next = max(q.next, reply.next)  # retention or damage: those offsets are gone
            return
        if reply.status != PullStatus.FOUND or not reply.payload:
            if reply.status == PullStatus.NO_NEW_MESSAGE and q.next == start:
                q.next = max(q.next, reply.next)  # the filter passed over these
            return
        take(self, r, q, reply, out, self._deliver)


    def _deliver(self, r: Receive, m: MessageExt) -> pb.Message:
        return self.deliver(self.table, r, m)

    def deliver(self, table: PopTable, r: Receive, m: MessageExt) -> pb.Message:
        """Hand ``m`` out (first time or again) under a new generation, as ``table``
        records it."""
        key = (r.group, r.topic, m.queue_id)
        prior = 0
        if self.journal is not None and table.attempt(*key, m.queue_offset) == 0:
            prior = self.journal.attempts_of(key, m.queue_offset)
        d: Delivery = table.deliver(r.group, r.topic, m.queue_id, m.queue_offset,
                                    r.invisible_s, self.clock(), prior)
        if self.journal is not None:
            self.journal.delivered(key, m.queue_offset, d.attempt)
        handle = self.codec.encode(Receipt(r.group, r.topic, m.queue_id, m.queue_offset,
                                           d.generation))
        log.debug("deliver %s %s:%d:%d generation %d attempt %d", r.group, r.topic,
                  m.queue_id, m.queue_offset, d.generation, d.attempt)
        return to_pb(m, namespace=r.namespace, receipt=handle, invisible_s=r.invisible_s,
                     attempt=d.attempt, store_host=self.store_host)

    # ---------------------------------------------------------------- ack, change
    def receipt(self, group: str, topic: str, handle: str) -> Receipt:
        try:
            rc = self.codec.decode(handle)
        except BadReceipt as exc:
            raise RmqError(Code.INVALID_RECEIPT_HANDLE, str(exc)) from None
        if (rc.group, rc.topic) != (group, topic):
            raise RmqError(Code.INVALID_RECEIPT_HANDLE, f"the receipt handle belongs to group "
                           f"{rc.group} on topic {rc.topic}, not {group} on {topic}")
        return rc

    async def ack(self, group: str, topic: str, handle: str) -> None:
        """Settle the delivery; the group's committed offset follows (durably) when the
        message was the lowest in flight of its queue, the journal keeps it otherwise."""
        rc = self.receipt(group, topic, handle)
        key = (group, topic, rc.queue)
        if await self.ack_earlier(rc, lambda: self.table.queue(*key), None):
            return
        try:
            q = self.table.ack(group, topic, rc.queue, rc.offset, rc.generation)
        except StaleReceipt as exc:
            raise RmqError(Code.INVALID_RECEIPT_HANDLE, str(exc)) from None
        await self.settle(key, q, rc.offset, None)

    async def ack_earlier(self, rc: Receipt, inflight: Callable[[], QueuePop | None],
                          client: str | None, dead_letter: str = "") -> bool:
        """The acknowledgement of a delivery made before the broker restarted (its handle
        still decodes: the key is kept). Settled here unless the message was delivered
        again since (then the handle is stale, refused): True when settled. With
        ``dead_letter`` (a reason) the message goes to the dead-letter queue first, unless
        settled. False at once (without awaiting) for a handle of this run.

        ``inflight`` reads the queue state the message would be in flight in now (or
        None); it is called again after every await, as a receive may deliver the message
        again while this one waits for the broker."""
        if rc.generation >= self.first_generation:
            return False
        key = (rc.group, rc.topic, rc.queue)
        _not_again(rc, inflight())
        stored = await self.bridge.call(self.conn, GetOffset(*key))
        assert isinstance(stored, OffsetReply)
        q = _not_again(rc, inflight())  # afresh: delivered again while GetOffset waited?
        if rc.offset < stored.offset or (q is not None and rc.offset < q.next):
            return True  # settled already (acknowledged, or covered by the group's offset)
        if dead_letter and not self.is_acked(key, rc.offset):
            await self._to_dlq(key, rc.offset, dead_letter)
            # delivered again while the dead letter was stored: the newer delivery counts
            # (the message is consumed again; its dead letter stays)
            _not_again(rc, inflight())
        if self.journal is not None:
            await self.journal.ack(key, rc.offset)  # passed over when the cursor gets there
        return True

    @property
    def first_generation(self) -> int:
        return self.journal.first_generation if self.journal is not None else 1

    async def _commit(self, group: str, topic: str, queue: int) -> None:
        q = self.table.queue(group, topic, queue)
        if q is not None:
            await self.commit((group, topic, queue), q, None)

    def change(self, group: str, topic: str, handle: str, invisible_s: float) -> str:
        """A new invisible duration from now; the new receipt handle."""
        check_invisible(invisible_s)
        rc = self.receipt(group, topic, handle)
        try:
            d = self.table.change(group, topic, rc.queue, rc.offset, rc.generation,
                                  invisible_s, self.clock())
        except StaleReceipt as exc:
            raise RmqError(Code.INVALID_RECEIPT_HANDLE, str(exc)) from None
        self.wake(group, topic)
        return self.codec.encode(Receipt(group, topic, rc.queue, rc.offset, d.generation))

    async def forward_pop(self, group: str, topic: str, handle: str, attempt: int,
                          limit: int) -> None:
        """``ForwardMessageToDeadLetterQueue`` of a SimpleConsumer's delivery."""
        rc = self.receipt(group, topic, handle)
        await self.forward(self.table, rc, lambda: self.table.queue(group, topic, rc.queue),
                           None, attempt, limit)


def _not_again(rc: Receipt, q: QueuePop | None) -> QueuePop | None:
    """Refuse a handle of before a restart whose message is in flight again in ``q``
    (delivered again since: only the newest handle counts); ``q`` otherwise."""
    if q is not None and rc.offset in q.inflight:
        raise RmqError(Code.INVALID_RECEIPT_HANDLE, f"message {rc.topic}:{rc.queue}:"
                       f"{rc.offset} of group {rc.group} was delivered again since the "
                       "broker restarted: only the newest receipt handle counts")
    return q


def decode(reply: PullReply, first: int, end: int, tags: list[str] | None
            ) -> list[MessageExt]:
    """The messages of a pull's answer at offsets [first, end) (a pull answers whole
    records: single records before ``first`` may be in it)."""
    hashes = None if tags is None else frozenset(tag_hash(t) for t in tags)
    try:
        return [m for m in decode_records(reply.payload, True, first, end, hashes)
                if first <= m.queue_offset < end]
    except RecordError as exc:
        raise RmqError(Code.INTERNAL_SERVER_ERROR, f"a stored record does not decode: {exc}"
                       ) from None


def take(pop: PopService, r: Receive, q: QueuePop, reply: PullReply, out: list[pb.Message],
         deliver: Callable[[Receive, MessageExt], pb.Message]) -> None:
    """Take the found messages from ``q.next`` on, up to the batch, passing over those of
    another tag and those acknowledged already (journaled before a restart); ``q.next``
    moves past what was taken or passed over."""
    wanted = None if r.tags is None else set(r.tags)
    for m in decode(reply, q.next, reply.next, r.tags):
        if len(out) >= r.batch:
            q.next = max(q.next, m.queue_offset)
            return
        if pop.is_acked((r.group, r.topic, m.queue_id), m.queue_offset):
            continue
        if wanted is None or m.tags in wanted:
            out.append(deliver(r, m))
    q.next = max(q.next, reply.next)

