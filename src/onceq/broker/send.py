"""The send service: producers' sends (``SEND``, ``SEND_BATCH``), idempotent writers'
sequenced sends (``SEND_SEQUENCED``) and consumers' send-backs to the retry topic
(``CONSUMER_SEND_BACK``). Each stores messages, wakes the pulls held on the queue and
answers once the write is durable (``durable.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..protocol.codes import RETRY_PREFIX
from ..protocol.errors import ErrorCode, OnceqError
from ..storage.store import check_name
from .fields import Response, int_field, split_parts, str_field, user_topic
from .idempotent import refuse_sequenced, send_sequenced

if TYPE_CHECKING:
    from ..storage.sequences import SequenceStore
    from ..storage.store import MessageStore
    from .config import BrokerConfig
    from .connection import Connection
    from .durable import DurableReplies
    from .metrics import BrokerMetrics
    from .retry import RetryService


class SendService:
    """Writes to the store. ``on_put(topic, queue)`` wakes the pulls held on a queue that
    got new messages. ``retry`` and ``metrics`` are set when the broker starts."""

    def __init__(self, config: BrokerConfig, store: MessageStore, sequences: SequenceStore,
                 durable: DurableReplies, on_put: Callable[[str, int], None]) -> None:
        self.config = config
        self.store = store
        self.sequences = sequences
        self.durable = durable
        self.on_put = on_put
        self.retry: RetryService | None = None
        self.metrics: BrokerMetrics | None = None

    def topic_for_write(self, topic: str) -> None:
        """Refuse the internal offsets topic; create a missing group retry topic (e.g. for
        ``onceq dlq resend`` before any member registered), or any missing topic when
        topics are created on first use (``auto_create_topics``)."""
        user_topic(topic)
        if topic in self.store.topics:
            return
        if topic.startswith(RETRY_PREFIX) and self.retry is not None:
            self.retry.ensure_group_topics(check_name("group", topic[len(RETRY_PREFIX):]))
        elif self.config.auto_create_topics:
            check_name("topic", topic)
            self.store.create_topic(topic, self.config.default_queues)

    def h_send(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes) -> Response:
        topic = str_field(h, "topic")
        qid = int_field(h, "queue")
        self.topic_for_write(topic)
        parts = split_parts(p)
        refuse_sequenced(topic, parts)
        res = self.store.put(topic, qid, parts)
        if len(res.duplicates) < len(parts):
            self.on_put(topic, qid)
        if self.metrics is not None:
            self.metrics.on_send(topic, len(parts), len(p), len(res.duplicates))
        if res.duplicates:
            header = {"queue": qid, "offsets": res.offsets, "dups": res.duplicates,
                      "dupq": res.duplicate_queues}
        else:
            header = {"queue": qid, "base": res.offsets[0], "n": len(res.offsets)}
        return self.durable.reply(conn, corr, header, end=res.end_position)

    def h_send_sequenced(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                         ) -> Response:
        """An idempotent writer's numbered batch (``idempotent.py``)."""
        topic = str_field(h, "topic")
        qid = int_field(h, "queue")
        self.topic_for_write(topic)
        parts = split_parts(p)
        header, end = send_sequenced(self.store, self.sequences, h, parts, topic=topic,
                                     queue=qid)
        if header["n"]:
            self.on_put(topic, qid)
        if self.metrics is not None:
            self.metrics.on_send(topic, len(parts), len(p), header["dup"])
        return self.durable.reply(conn, corr, header, end=end)

    def h_send_back(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                    ) -> Response:
        """A message the consumer failed: to the group's retry topic, or its DLQ."""
        assert self.retry is not None
        group = check_name("group", str_field(h, "group"))
        max_reconsume = int_field(h, "max_reconsume", 16)
        if not 0 <= max_reconsume <= 10_000:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "max_reconsume must be 0..10000")
        reason = h.get("dlq_reason", "")
        if not isinstance(reason, str):
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "field 'dlq_reason' must be a string")
        res = self.retry.send_back(group, str_field(h, "topic"), int_field(h, "queue"),
                                   int_field(h, "offset"), int_field(h, "delay_level", 0),
                                   max_reconsume, reason)
        return self.durable.reply(conn, corr, res)
