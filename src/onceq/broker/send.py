"""The send service: producers' sends (``SEND``, ``SEND_BATCH``, and ``SEND_RECORDS``,
a record batch stored as sent), idempotent writers'
sequenced sends (``SEND_SEQUENCED``), consumers' send-backs to the retry topic and resends
of dead letters (``CONSUMER_SEND_BACK``). Each stores messages, wakes the pulls held on the
queue and answers once the write is durable (``durable.py``).

Sends name user topics only: system topics (``%...``) are written by the broker alone
(``fields.client_written_topic``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..log.batch import check_batch
from ..log.delay import DELAYED, is_delayed
from ..log.record import RecordError
from ..log.sequence import SEQUENCED, SequenceError, check_writer_id
from ..protocol.codes import dlq_topic
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import SendBackReply, SendReply, SequencedReply
from ..storage.errors import MalformedMessage
from ..storage.store import check_name
from .fields import client_written_topic, is_system_topic, split_parts, user_topic
from .idempotent import refuse_sequenced, refuse_sequenced_flag, send_sequenced
from .writer_ids import WriterIds

if TYPE_CHECKING:
    from ..protocol.requests import Send, SendBack, SendRecords, SendSequenced
    from ..storage.put import PutResult
    from ..storage.sequences import SequenceStore
    from ..storage.store import MessageStore
    from .config import BrokerConfig
    from .durable import DurableReplies
    from .fields import Call
    from .fuse import QueueFuse
    from .metrics import BrokerMetrics
    from .retry import RetryService


class SendService:
    """Writes to the store. ``on_put(topic, queue)`` wakes the pulls held on a queue that
    got new messages. ``retry`` and ``metrics`` are set when the broker starts."""

    def __init__(self, config: BrokerConfig, store: MessageStore, sequences: SequenceStore,
                 durable: DurableReplies, on_put: Callable[[str, int], None]) -> None:
        self.config = config
        self.writers = WriterIds()  # which connection and user each writer id belongs to
        self.store = store
        self.sequences = sequences
        self.durable = durable
        self.on_put = on_put
        self.retry: RetryService | None = None
        self.metrics: BrokerMetrics | None = None
        self.fuse: QueueFuse | None = None  # the queue-depth fuse, when on (fuse.py)

    def topic_for_write(self, topic: str) -> None:
        """Make sure a topic a client names exists (sends, ``GET_TOPIC``): refuse the
        internal offsets topic; create a missing user topic when topics are created on first
        use (``auto_create_topics``). System topics are created by the broker when it first
        writes them: a group's retry topic at the group's first send-back."""
        user_topic(topic)
        if topic in self.store.topics.deleting:  # its messages would go with it
            raise OnceqError(ErrorCode.TOPIC_NOT_EXIST,
                             f"topic {topic!r} is being deleted: send again once it is gone")
        if topic in self.store.topics:
            return
        if self.config.auto_create_topics and not is_system_topic(topic):
            check_name("topic", topic)
            self.store.create_topic(topic, self.config.default_queues)

    def h_send(self, call: Call, req: Send) -> SendReply | None:
        topic = client_written_topic(req.topic)
        qid = req.queue
        self.topic_for_write(topic)
        if self.fuse is not None:
            self.fuse.check(topic, qid)
        parts = split_parts(req.payload)
        refuse_sequenced(parts)
        if any(is_delayed(p) for p in parts):
            return self._send_delayed(call, topic, qid, parts, len(req.payload))
        res = self.store.put(topic, qid, parts)
        if len(res.duplicates) < len(parts):
            self.on_put(topic, qid)
        if self.metrics is not None:
            self.metrics.on_send(topic, len(parts), len(req.payload), len(res.duplicates))
        return self.durable.reply(call, send_reply(qid, res), end=res.end_position)

    def h_send_records(self, call: Call, req: SendRecords) -> SendReply | None:
        """A record batch: checked whole here, stored as sent (``MessageStore.put_batch``)."""
        topic = client_written_topic(req.topic)
        qid = req.queue
        self.topic_for_write(topic)
        if self.fuse is not None:
            self.fuse.check(topic, qid)
        try:
            checked = check_batch(req.payload)
        except RecordError as exc:
            raise MalformedMessage(f"malformed record batch: {exc}") from None
        if checked[3] & SEQUENCED:
            refuse_sequenced_flag()
        if checked[3] & DELAYED:
            refuse_delayed_batch()
        res = self.store.put_batch(topic, qid, req.payload, checked)
        n = len(checked[0])
        if len(res.duplicates) < n:
            self.on_put(topic, qid)
        if self.metrics is not None:
            self.metrics.on_send(topic, n, len(req.payload), len(res.duplicates))
        return self.durable.reply(call, send_reply(qid, res), end=res.end_position)

    def h_send_sequenced(self, call: Call, req: SendSequenced) -> SequencedReply | None:
        """An idempotent writer's numbered batch (``idempotent.py``)."""
        topic = client_written_topic(req.topic)
        try:
            writer = check_writer_id(req.writer)
        except SequenceError as exc:
            raise OnceqError(ErrorCode.INVALID_SEQUENCE, str(exc)) from None
        self.writers.claim(call.conn, writer)
        self.topic_for_write(topic)
        if self.fuse is not None:
            self.fuse.check(topic, req.queue)
        parts = split_parts(req.payload)
        if any(is_delayed(p) for p in parts):
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "a delayed message cannot be "
                             "sent by an idempotent writer (SEND_SEQUENCED)")
        reply, end = send_sequenced(self.store, self.sequences, req, parts, topic=topic)
        if reply.n:
            self.on_put(topic, req.queue)
        if self.metrics is not None:
            self.metrics.on_send(topic, len(parts), len(req.payload), reply.dup)
        return self.durable.reply(call, reply, end=end)

    def _send_delayed(self, call: Call, topic: str, qid: int, parts: list[memoryview],
                      size: int) -> SendReply | None:
        """A delayed message (the ``DELAYED`` flag, ``log/delay.py``): stored in the timer
        at once, in its queue at its time (``RetryService.send_delayed``). The answer
        names the target queue and offset -1 (its offset there is not known yet)."""
        assert self.retry is not None
        if len(parts) != 1:
            refuse_delayed_batch()
        res = self.retry.send_delayed(topic, qid, parts[0], self.config.timer_max_delay_s)
        if self.metrics is not None:
            self.metrics.on_send(topic, 1, size, len(res.duplicates))
        reply = SendReply(qid, [-1], res.duplicates, [qid] * len(res.duplicates))
        return self.durable.reply(call, reply, end=res.end_position)

    def h_send_back(self, call: Call, req: SendBack) -> SendBackReply | None:
        """A message the consumer failed: to the group's retry topic, or its DLQ.

        With ``resend`` (``onceq dlq resend``), the message at ``offset`` of the group's
        dead-letter topic (``topic`` must name it, ``queue`` 0) goes back to the group's
        retry topic at once; the answer says where its copy is."""
        assert self.retry is not None
        group = check_name("group", req.group)
        if req.resend:
            return self._resend(call, group, req)
        if not 0 <= req.max_reconsume <= 10_000:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "max_reconsume must be 0..10000")
        reply = self.retry.send_back(group, user_topic(req.topic), req.queue, req.offset,
                                     req.delay_level, req.max_reconsume, req.dlq_reason)
        return self.durable.reply(call, reply)

    def _resend(self, call: Call, group: str, req: SendBack) -> SendBackReply | None:
        assert self.retry is not None
        dlq = dlq_topic(group)
        if req.topic != dlq or req.queue != 0:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                             f"a resend names the group's dead-letter queue {dlq}[0]")
        res = self.retry.resend_dead_letter(group, req.offset)
        duplicate = bool(res.duplicates)
        queue = res.duplicate_queues[0] if duplicate else 0
        reply = SendBackReply(queue=queue, offset=res.offsets[0], duplicate=duplicate)
        return self.durable.reply(call, reply, end=res.end_position)


def refuse_delayed_batch() -> None:
    raise OnceqError(ErrorCode.INVALID_ARGUMENT, "a delayed message is sent alone, not in "
                     "a batch (as RocketMQ refuses delayed batch messages)")


def send_reply(queue: int, res: PutResult) -> SendReply:
    """Where a send's messages are: every message's offset, with the indexes and queues of
    those the dedup window recognised (stored before, at their first copy's place)."""
    return SendReply(queue, res.offsets, res.duplicates, res.duplicate_queues)
