"""A broker's side of moving a queue to another broker group (``onceq topic reassign``,
docs/cluster.md "Moving a queue to another group").

* ``QUEUE_STATE``: the queue's ends here and every consumer group's committed offset,
  whatever its route says (the mover reads the group it leaves, also once handed over).
* ``COPY_QUEUE``: on the group a queue moves to (its route says so), the queue's messages
  stored from the offset they had (``start`` must be the queue's end here: a copy sent
  twice stores nothing the second time, and the answer says where the queue ends; with
  ``restart``, an empty queue here restarts at a later ``start``), and
  consumer offsets taken where higher. Both as any write: flushed and replicated before
  the answer.

The queue keeps its offsets across the move: its messages are stored here from the first
one its group still holds (offset 0, or later when retention removed its head there), in
order, so offset ``n`` names the same message on both groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import QueueStateReply
from ..protocol.requests import CopyQueue, QueueState
from ..storage.store import check_name
from .fields import split_parts

if TYPE_CHECKING:
    from ..protocol.schema import Message
    from ..storage.store import MessageStore
    from .durable import DurableReplies
    from .fields import Call, Handler
    from .routes import Routes


class QueueMoves:
    def __init__(self, store: MessageStore, routes: Routes, durable: DurableReplies) -> None:
        self.store = store
        self.routes = routes
        self.durable = durable

    def handlers(self) -> dict[type[Message], Handler]:
        return {QueueState: self.h_state, CopyQueue: self.h_copy}

    def _state(self, topic: str, queue: int) -> QueueStateReply:
        lo, hi = self.store.min_max(topic, queue)
        offsets = {}
        for group, topics in self.store.offsets.groups.items():
            committed = topics.get(topic, {}).get(str(queue))
            if committed is not None:
                offsets[group] = committed
        return QueueStateReply(lo, hi, offsets)

    def h_state(self, call: Call, req: QueueState) -> QueueStateReply:
        return self._state(req.topic, req.queue)

    def h_copy(self, call: Call, req: CopyQueue) -> QueueStateReply | None:
        topic, queue = req.topic, req.queue
        route = self.routes.routes.get(topic)
        move = None if route is None else route.move_of(queue)
        if move is None or move[0] != self.routes.group:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, (
                f"queue {queue} of topic {topic!r} is not moving to this broker group "
                f"({self.routes.group!r}): nothing is copied"))
        if topic not in self.store.topics:  # (a group holding none of its queues yet)
            self.routes.serve_created(call, req, self._copy, check=False)
            return None
        return self._copy(call, req)

    def _copy(self, call: Call, req: CopyQueue) -> QueueStateReply | None:
        topic, queue = req.topic, req.queue
        if topic not in self.store.topics:
            raise OnceqError(ErrorCode.SERVICE_UNAVAILABLE, (
                f"topic {topic!r} is not created on this broker group yet: try again"))
        lo, end = self.store.min_max(topic, queue)
        last = self.store.log.end
        if req.restart and req.start > end and lo == end:
            # its head went to retention on the group it leaves: it starts here where its
            # first message left is (or, none left, where its next one will be)
            self.store.restart_queue(topic, queue, req.start)
            end = req.start
        if req.payload and req.start == end:
            parts = split_parts(req.payload)
            # every copy stored (offsets kept), and its unique key known to the window
            res = self.store.put(topic, queue, parts, dedup=False, register=True)
            last = res.end_position
        for group, offset in (req.offsets or {}).items():
            if not isinstance(offset, int) or offset < 0:
                raise OnceqError(ErrorCode.INVALID_ARGUMENT, f"bad offset {offset!r}")
            group = check_name("group", group)
            if offset > self.store.get_offset(group, topic, queue):
                last = max(last, self.store.commit_offset(group, topic, queue, offset))
        return self.durable.reply(call, self._state(topic, queue), end=last)
