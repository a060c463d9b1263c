"""Topic administration: ``CREATE_TOPIC``, ``DELETE_TOPIC``, ``LIST_TOPICS``, ``GET_TOPIC``
and ``TOPIC_STATUS`` (per queue: offsets and store times). System topics (``%...``) are
created and deleted by the broker only: a client deleting ``%SCHEDULE%`` would drop every
pending retry, ``%TRACE%`` the audit's evidence. The internal offsets journal topic is not
listed either."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..log.offset_record import OFFSETS_TOPIC
from ..protocol.codes import RequestCode
from ..protocol.errors import ErrorCode, OnceqError
from .fields import Handler, Response, client_written_topic, int_field, str_field

if TYPE_CHECKING:
    from ..storage.store import MessageStore
    from .connection import Connection

log = logging.getLogger("onceq.broker")


class TopicAdmin:
    """``topic_for_write(topic)`` creates a missing topic on first use (when enabled), as
    a send does; ``forget_topic(topic)`` drops a deleted topic from the broker's tables."""

    def __init__(self, store: MessageStore, default_queues: int, *,
                 topic_for_write: Callable[[str], None],
                 forget_topic: Callable[[str], None]) -> None:
        self.store = store
        self.default_queues = default_queues
        self.topic_for_write = topic_for_write
        self.forget_topic = forget_topic

    def handlers(self) -> dict[int, Handler]:
        return {RequestCode.CREATE_TOPIC: self.h_create_topic,
                RequestCode.DELETE_TOPIC: self.h_delete_topic,
                RequestCode.LIST_TOPICS: self.h_list_topics,
                RequestCode.GET_TOPIC: self.h_get_topic,
                RequestCode.TOPIC_STATUS: self.h_topic_status}

    def h_create_topic(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                       ) -> Response:
        name = client_written_topic(str_field(h, "topic"))
        queues = int_field(h, "queues", self.default_queues)
        if h.get("exclusive") and name in self.store.topics:
            raise OnceqError(ErrorCode.TOPIC_EXISTS, f"topic {name!r} already exists")
        t = self.store.create_topic(name, queues)
        log.info("topic %s created/updated with %d queues", name, t.queues)
        return 0, {"topic": t.name, "queues": t.queues}, b""

    def h_delete_topic(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                       ) -> Response:
        name = client_written_topic(str_field(h, "topic"))
        self.store.delete_topic(name)
        self.forget_topic(name)
        log.info("topic %s deleted", name)
        return 0, None, b""

    def h_list_topics(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                      ) -> Response:
        topics = [{"topic": t.name, "queues": t.queues} for t in
                  sorted(self.store.topics.values(), key=lambda t: t.name)
                  if t.name != OFFSETS_TOPIC]
        return 0, {"topics": topics}, b""

    def h_get_topic(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                    ) -> Response:
        name = str_field(h, "topic")
        self.topic_for_write(name)
        t = self.store.get_topic(name)
        return 0, {"topic": t.name, "queues": t.queues}, b""

    def h_topic_status(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                       ) -> Response:
        """Per queue: min and max offsets, store times of the first and last message."""
        store = self.store
        topic = h.get("topic")
        if not isinstance(topic, str):
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "field 'topic' must be a string")
        t = store.get_topic(topic)
        queues = []
        for q in range(t.queues):
            lo, hi = store.min_max(topic, q)
            first, last = store.store_times(topic, q)
            queues.append({"queue": q, "min": lo, "max": hi, "first_store_ms": first,
                           "last_store_ms": last})
        return 0, {"topic": topic, "queues": queues}, b""
