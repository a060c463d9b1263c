"""Topic administration: ``CREATE_TOPIC``, ``DELETE_TOPIC``, ``LIST_TOPICS``, ``GET_TOPIC``
and ``TOPIC_STATUS`` (per queue: offsets and store times). System topics (``%...``) are
created and deleted by the broker only: a client deleting ``%SCHEDULE%`` would drop every
pending retry, ``%TRACE%`` the audit's evidence. The internal offsets journal topic is not
listed either."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..log.offset_record import OFFSETS_TOPIC
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import Empty, TopicInfo, TopicList, TopicStatusReply
from ..protocol.requests import CreateTopic, DeleteTopic, GetTopic, ListTopics, TopicStatus
from .fields import Call, Handler, client_written_topic

if TYPE_CHECKING:
    from ..protocol.schema import Message
    from ..storage.store import MessageStore

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

    def handlers(self) -> dict[type[Message], Handler]:
        return {CreateTopic: self.h_create_topic, DeleteTopic: self.h_delete_topic,
                ListTopics: self.h_list_topics, GetTopic: self.h_get_topic,
                TopicStatus: self.h_topic_status}

    def h_create_topic(self, call: Call, req: CreateTopic) -> TopicInfo:
        name = client_written_topic(req.topic)
        queues = self.default_queues if req.queues is None else req.queues
        if req.exclusive and name in self.store.topics:
            raise OnceqError(ErrorCode.TOPIC_EXISTS, f"topic {name!r} already exists")
        t = self.store.create_topic(name, queues)
        log.info("topic %s created/updated with %d queues", name, t.queues)
        return TopicInfo(t.name, t.queues)

    def h_delete_topic(self, call: Call, req: DeleteTopic) -> Empty:
        name = client_written_topic(req.topic)
        self.store.delete_topic(name)
        self.forget_topic(name)
        log.info("topic %s deleted", name)
        return Empty()

    def h_list_topics(self, call: Call, req: ListTopics) -> TopicList:
        return TopicList([{"topic": t.name, "queues": t.queues} for t in
                          sorted(self.store.topics.values(), key=lambda t: t.name)
                          if t.name != OFFSETS_TOPIC])

    def h_get_topic(self, call: Call, req: GetTopic) -> TopicInfo:
        self.topic_for_write(req.topic)
        t = self.store.get_topic(req.topic)
        return TopicInfo(t.name, t.queues)

    def h_topic_status(self, call: Call, req: TopicStatus) -> TopicStatusReply:
        """Per queue: min and max offsets, store times of the first and last message."""
        store = self.store
        topic = req.topic
        t = store.get_topic(topic)
        queues = []
        for q in range(t.queues):
            lo, hi = store.min_max(topic, q)
            first, last = store.reader.store_times(topic, q)
            queues.append({"queue": q, "min": lo, "max": hi, "first_store_ms": first,
                           "last_store_ms": last})
        return TopicStatusReply(topic, queues)
