"""The send service: producers' sends (``SEND``, ``SEND_BATCH``), idempotent writers'
sequenced sends (``SEND_SEQUENCED``), consumers' send-backs to the retry topic and resends
of dead letters (``CONSUMER_SEND_BACK``). Each stores messages, wakes the pulls held on the
queue and answers once the write is durable (``durable.py``).

Sends name user topics only: system topics (``%...``) are written by the broker alone
(``fields.client_written_topic``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..protocol.codes import dlq_topic
from ..protocol.errors import ErrorCode, OnceqError
from ..storage.store import check_name
from .fields import (
    Response,
    client_written_topic,
    int_field,
    is_system_topic,
    split_parts,
    str_field,
    user_topic,
)
from .idempotent import refuse_sequenced, send_sequenced

if TYPE_CHECKING:
    from ..storage.put import PutResult
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
        """Make sure a topic a client names exists (sends, ``GET_TOPIC``): refuse the
        internal offsets topic; create a missing user topic when topics are created on first
        use (``auto_create_topics``). System topics are created by the broker when it first
        writes them: a group's retry topic at the group's first send-back."""
        user_topic(topic)
        if topic in self.store.topics:
            return
        if self.config.auto_create_topics and not is_system_topic(topic):
            check_name("topic", topic)
            self.store.create_topic(topic, self.config.default_queues)

    def h_send(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes) -> Response:
        topic = client_written_topic(str_field(h, "topic"))
        qid = int_field(h, "queue")
        self.topic_for_write(topic)
        parts = split_parts(p)
        refuse_sequenced(parts)
        res = self.store.put(topic, qid, parts)
        if len(res.duplicates) < len(parts):
            self.on_put(topic, qid)
        if self.metrics is not None:
            self.metrics.on_send(topic, len(parts), len(p), len(res.duplicates))
        return self.durable.reply(conn, corr, send_answer(qid, res), end=res.end_position)

    def h_send_sequenced(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                         ) -> Response:
        """An idempotent writer's numbered batch (``idempotent.py``)."""
        topic = client_written_topic(str_field(h, "topic"))
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
        """A message the consumer failed: to the group's retry topic, or its DLQ.

        With ``resend: true`` (``onceq dlq resend``), the message at ``offset`` of the
        group's dead-letter topic (``topic`` must name it, ``queue`` 0) goes back to the
        group's retry topic at once; answered like a ``SEND`` to that topic."""
        assert self.retry is not None
        group = check_name("group", str_field(h, "group"))
        resend = h.get("resend", False)
        if not isinstance(resend, bool):
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "field 'resend' must be a boolean")
        if resend:
            return self._resend(conn, corr, group, h)
        max_reconsume = int_field(h, "max_reconsume", 16)
        if not 0 <= max_reconsume <= 10_000:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "max_reconsume must be 0..10000")
        reason = h.get("dlq_reason", "")
        if not isinstance(reason, str):
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "field 'dlq_reason' must be a string")
        res = self.retry.send_back(group, user_topic(str_field(h, "topic")),
                                   int_field(h, "queue"), int_field(h, "offset"),
                                   int_field(h, "delay_level", 0), max_reconsume, reason)
        return self.durable.reply(conn, corr, res)

    def _resend(self, conn: Connection, corr: int, group: str, h: dict[str, Any]
                ) -> Response:
        assert self.retry is not None
        dlq = dlq_topic(group)
        if str_field(h, "topic") != dlq or int_field(h, "queue") != 0:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                             f"a resend names the group's dead-letter queue {dlq}[0]")
        res = self.retry.resend_dead_letter(group, int_field(h, "offset"))
        return self.durable.reply(conn, corr, send_answer(0, res), end=res.end_position)


def send_answer(queue: int, res: PutResult) -> dict[str, Any]:
    """The answer to a send: the first offset and the count, or, when the dedup window
    recognised some messages, every message's offset with the duplicates' indexes and
    queues."""
    if res.duplicates:
        return {"queue": queue, "offsets": res.offsets, "dups": res.duplicates,
                "dupq": res.duplicate_queues}
    return {"queue": queue, "base": res.offsets[0], "n": len(res.offsets)}
