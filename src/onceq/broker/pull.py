"""The pull service: consumers' pulls (``PULL``) under the queue-ownership rules
(``ownership.py``: the reset fence, the orderly lock, the access lock); long polling of
empty pulls (``longpoll.py``) and their retries when messages arrive; the offset queries
(``QUERY_OFFSETS``, ``SEARCH_OFFSET``, ``GET_OFFSET``).

A pull may carry a commit of the group's ack offset (piggy-backed; journaled with the next
batch, not waited for). A pull refused by a lock or the fence is answered ``LOCKED``: no
messages, the same next offset; the client retries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..log.record import tag_hash
from ..protocol.codes import PullStatus
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import OffsetReply, PullReply, QueueOffsets
from ..storage.store import check_name
from .fields import Call, user_topic
from .longpoll import HeldPull, PullHold
from .ownership import Refusal
from .store_errors import as_wire_error

if TYPE_CHECKING:
    from ..protocol.requests import GetOffset, Pull, QueryOffsets, SearchOffset
    from ..storage.store import MessageStore
    from .config import BrokerConfig
    from .metrics import BrokerMetrics
    from .ownership_service import OwnershipService
    from .trace import DeliveryTrace


@dataclass(slots=True, eq=False)
class PullJob:
    """A pull being answered (now, or when held, when it wakes): the request's bounds
    clamped to the broker's, and what the ownership core decided."""

    topic: str
    queue: int
    offset: int
    max_msgs: int
    max_bytes: int
    suspend_ms: int
    tag_hashes: frozenset[int] | None
    group: str | None = None  # set when the pull runs under the group's access lock
    client: str | None = None
    trace: tuple[str, str, bool] | None = None  # (group, client, lock acquired): traced
    behind: int | None = None  # the group's committed offset, above the pull's commit


class PullService:
    """Answers pulls and holds the empty ones (``holds``). ``metrics`` is set when the
    broker starts."""

    def __init__(self, config: BrokerConfig, store: MessageStore, *,
                 owners: OwnershipService, trace: DeliveryTrace) -> None:
        self.config = config
        self.store = store
        self.owners = owners
        self.trace = trace
        self.holds = PullHold(self._retry_pull)
        self.metrics: BrokerMetrics | None = None
        # in a broker group: the first offset of a queue above the high watermark (None:
        # every stored offset may be read); consumers never see past it
        self.visible_end: Callable[[str, int], int | None] | None = None

    # ---------------------------------------------------------------- held pulls
    def wake(self, topic: str, queue: int) -> None:
        """New messages on a queue (or its lock changed): retry the pulls held on it."""
        self.holds.notify((topic, queue))

    def wake_topic(self, topic: str) -> None:
        """The topic was deleted: its held pulls are answered (``TOPIC_NOT_EXIST``)."""
        for key in [k for k in self.holds.held if k[0] == topic]:
            self.holds.notify(key)

    def give_up(self, *, client: str, topic: str, queue: int) -> None:
        """``client`` gave the queue up: answer its held pulls of it ``LOCKED`` now."""
        for held in self.holds.drop_client((topic, queue), client):
            held.conn.answer(held.corr_id, self._locked(topic, queue, offset=held.job.offset))

    def _locked(self, topic: str, queue: int, *, offset: int) -> PullReply:
        """A refused pull: "queue is locked by another client", same next offset."""
        lo, hi = self.store.min_max(topic, queue)
        return PullReply(PullStatus.LOCKED, offset, lo, hi)

    # ---------------------------------------------------------------- pulls
    def _job(self, req: Pull) -> PullJob:
        cfg = self.config
        max_bytes = cfg.max_pull_bytes if req.max_bytes is None else req.max_bytes
        tags = req.tags
        return PullJob(user_topic(req.topic), req.queue, req.offset,
                       min(max(req.max_msgs, 1), cfg.max_pull_msgs),
                       min(max(max_bytes, 1), cfg.max_pull_bytes), max(req.suspend_ms, 0),
                       None if tags is None else frozenset(tag_hash(t) for t in tags))

    def h_pull(self, call: Call, req: Pull) -> PullReply | None:
        job = self._job(req)
        topic, queue = job.topic, job.queue
        self.store.get_topic(topic)
        group = None if req.group is None else check_name("group", req.group)
        commit, client = req.commit, req.client
        if group is not None:
            owners = self.owners
            owners.seen(group, client, req.reset_gen)
            traced = group in self.trace.groups  # delivery trace (trace.py)
            d = owners.pull(group, client, topic, queue, job.offset)
            if d.refused is not None:  # fenced, or another client holds the queue: its
                return self._locked(topic, queue, offset=job.offset)  # commit too
            if d.corrected:  # taken over and moved forward to the group's offset: the
                commit = None  # client's commit is its stale start, not progress
            if d.lock is not None:  # under the access lock
                job.offset = d.offset
                job.group, job.client = group, client
            if traced:
                acquired = d.lock is not None and d.lock.previous_holder != client
                job.trace = (group, client or "", acquired)
            if commit is not None and commit >= 0:
                # journaled with the next batch, not waited for: a consumer sends its
                # finished offsets again after a reconnect (and with its next pull)
                locked = d.lock is not None  # the pull just ran checks 1-3 under the lock
                v, _ = owners.commit(group, client, topic, queue, commit, later=True,
                                     checked=locked, locked=locked)
                if v.refused is Refusal.BEHIND:  # its process queue is stale: the group
                    job.behind = v.stored  # consumed further; answered at once
        reply = self._do_pull(job, final=job.behind is not None)
        if reply is None:
            seconds = min(job.suspend_ms / 1000, self.config.long_poll_max_s)
            if job.client is not None:  # a suspended holder is alive: keep its lock
                self.owners.touch(group, client, topic, queue)
            self.holds.hold((topic, queue), HeldPull(call.conn, call.corr, job), seconds)
        return reply

    def _do_pull(self, job: PullJob, final: bool = False) -> PullReply | None:
        """Run a pull; None means 'nothing yet, hold it' (only when it may be held)."""
        max_msgs = job.max_msgs
        hidden = None if self.visible_end is None else self.visible_end(job.topic, job.queue)
        if hidden is not None:  # offsets from ``hidden`` on are not replicated enough yet
            if job.offset >= hidden:
                lo, hi = self.store.min_max(job.topic, job.queue)
                if lo <= job.offset <= hi:
                    if job.suspend_ms > 0 and not final:
                        return None
                    return PullReply(PullStatus.NO_NEW_MESSAGE, job.offset, lo, hidden,
                                     0, job.behind)
            else:
                max_msgs = min(max_msgs, hidden - job.offset)
        r = self.store.get(job.topic, job.queue, job.offset, max_msgs, job.max_bytes,
                           job.tag_hashes)
        if r.status == PullStatus.NO_NEW_MESSAGE and job.suspend_ms > 0 and not final:
            if r.next_offset != job.offset:
                job.offset = r.next_offset  # filtered entries skipped: wait from there
            return None
        if r.status == PullStatus.FOUND:
            if job.client is not None:
                self.owners.delivered(job.group, job.topic, job.queue, r.next_offset)
            if job.trace is not None:
                self.trace.delivered(*job.trace, job.topic, job.queue, r.payload,
                                     job.offset, r.next_offset, job.tag_hashes)
            if self.metrics is not None:
                self.metrics.on_pull(job.topic, r.count, len(r.payload))
        damaged = None
        if r.status == PullStatus.DAMAGED:  # offsets [damaged[0], damaged[1]) are lost
            damaged = [job.offset, r.next_offset]
        max_offset = r.max_offset if hidden is None else min(r.max_offset, hidden)
        return PullReply(PullStatus(r.status), r.next_offset, r.min_offset, max_offset,
                         r.count, job.behind, damaged, r.payload)

    def _retry_pull(self, held: HeldPull, final: bool) -> bool:
        job: PullJob = held.job
        try:
            if job.topic not in self.store.topics:
                raise OnceqError(ErrorCode.TOPIC_NOT_EXIST, "topic was deleted")
            if job.client is not None and self.owners.holder(
                    job.group, job.topic, job.queue) != job.client:
                held.conn.answer(held.corr_id,
                                 self._locked(job.topic, job.queue, offset=job.offset))
                return True
            reply = self._do_pull(job, final)
        except Exception as exc:  # answer it: the puller must not wait for its timeout
            err = as_wire_error(exc)
            held.conn.respond(held.corr_id, int(err.code), {**err.details,
                                                            "message": err.message})
            return True
        if reply is None:
            return False
        held.conn.answer(held.corr_id, reply)
        return True

    # ---------------------------------------------------------------- offset queries
    def h_query_offsets(self, call: Call, req: QueryOffsets) -> QueueOffsets:
        lo, hi = self.store.min_max(req.topic, req.queue)
        hidden = None if self.visible_end is None else self.visible_end(req.topic, req.queue)
        return QueueOffsets(lo, hi if hidden is None else min(hi, hidden))

    def h_search_offset(self, call: Call, req: SearchOffset) -> OffsetReply:
        return OffsetReply(self.store.reader.search_offset(req.topic, req.queue, req.ts))

    def h_get_offset(self, call: Call, req: GetOffset) -> OffsetReply:
        """The group's ack offset on a queue."""
        group = check_name("group", req.group)
        return OffsetReply(self.store.get_offset(group, req.topic, req.queue))
