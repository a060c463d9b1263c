"""Topic administration: ``CREATE_TOPIC``, ``DELETE_TOPIC``, ``LIST_TOPICS``, ``GET_TOPIC``
and ``TOPIC_STATUS`` (per queue: offsets and store times). System topics (``%...``) are
created and deleted by the broker only: a client deleting ``%SCHEDULE%`` would drop every
pending retry, ``%TRACE%`` the audit's evidence. The internal offsets journal topic is not
listed either."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from ..log.offset_record import OFFSETS_TOPIC
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import Empty, TopicInfo, TopicList, TopicStatusReply
from ..protocol.requests import CreateTopic, DeleteTopic, GetTopic, ListTopics, TopicStatus
from ..storage.errors import StorageError
from ..storage.failures import storage_error
from .fields import Call, Handler, client_written_topic
from .store_errors import wire_error

if TYPE_CHECKING:
    from ..protocol.schema import Message
    from ..storage.store import MessageStore

log = logging.getLogger("onceq.broker")

DIRS_ON_LOOP = 16  # new queues whose index directories are made on the event loop


class TopicAdmin:
    """``topic_for_write(topic)`` creates a missing topic on first use (when enabled), as
    a send does; ``forget_topic(topic)`` drops a deleted topic from the broker's tables."""

    def __init__(self, store: MessageStore, default_queues: int, *,
                 topic_for_write: Callable[[str], None],
                 forget_topic: Callable[[str], None],
                 off_loop: Callable[..., Awaitable[Any]]) -> None:
        self.store = store
        self.default_queues = default_queues
        self.topic_for_write = topic_for_write
        self.forget_topic = forget_topic
        self.off_loop = off_loop  # runs blocking file work in a thread
        self._tasks: set[asyncio.Task[None]] = set()

    def handlers(self) -> dict[type[Message], Handler]:
        return {CreateTopic: self.h_create_topic, DeleteTopic: self.h_delete_topic,
                ListTopics: self.h_list_topics, GetTopic: self.h_get_topic,
                TopicStatus: self.h_topic_status}

    def h_create_topic(self, call: Call, req: CreateTopic) -> TopicInfo | None:
        """A topic with more than ``DIRS_ON_LOOP`` new queues gets their index directories
        made in a thread first (a thousand take a good part of a second), then is created
        on the loop as any other; the answer comes then."""
        name = client_written_topic(req.topic)
        queues = self.default_queues if req.queues is None else req.queues
        topics = self.store.topics
        if req.exclusive and name in topics:
            raise OnceqError(ErrorCode.TOPIC_EXISTS, f"topic {name!r} already exists")
        old = topics.get(name)
        first = old.queues if old is not None else 0
        if queues - first <= DIRS_ON_LOOP:
            return self._create(name, queues)

        async def create() -> TopicInfo:
            await self.off_loop(topics.make_queue_dirs, name, first, queues)
            if req.exclusive and name in topics:  # created meanwhile
                raise OnceqError(ErrorCode.TOPIC_EXISTS, f"topic {name!r} already exists")
            return self._create(name, queues)

        self._later(call, create())
        return None

    def _create(self, name: str, queues: int) -> TopicInfo:
        t = self.store.create_topic(name, queues)
        log.info("topic %s created/updated with %d queues", name, t.queues)
        return TopicInfo(t.name, t.queues)

    def h_delete_topic(self, call: Call, req: DeleteTopic) -> Empty:
        """The topic is gone when this answers; its index files are removed in a thread."""
        name = client_written_topic(req.topic)
        aside = self.store.delete_topic(name, keep_files=True)
        self.forget_topic(name)
        log.info("topic %s deleted", name)
        if aside is not None:
            self._spawn(self._remove(aside))
        return Empty()

    async def _remove(self, path: str) -> None:
        try:
            await self.off_loop(self.store.files.rmtree, path)
        except OSError as exc:  # the next open drops it
            log.warning("cannot remove the index files of a deleted topic (%s): %s", path, exc)

    def _later(self, call: Call, work: Coroutine[Any, Any, Message]) -> None:
        """Answer ``call`` with what ``work`` returns, or with its error's code."""

        async def run() -> None:
            try:
                call.answer(await work)
            except OnceqError as exc:
                call.fail(exc)
            except StorageError as exc:
                call.fail(wire_error(exc))
            except OSError as exc:
                call.fail(wire_error(storage_error(exc, "the request failed")))
            except Exception as exc:
                log.exception("topic administration failed")
                call.fail(OnceqError(ErrorCode.SYSTEM_ERROR, f"internal: {exc}"))

        self._spawn(run())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
