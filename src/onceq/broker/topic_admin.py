"""Topic administration: ``CREATE_TOPIC``, ``DELETE_TOPIC``, ``LIST_TOPICS``, ``GET_TOPIC``
and ``TOPIC_STATUS`` (per queue: offsets and store times). A ``CREATE_TOPIC`` naming a
``follow_group`` makes the topic's queues follow that group (``queue_scaler.py``).

System topics (``%...``) are created and deleted by the broker only: a client deleting
``%SCHEDULE%`` would drop every pending retry, ``%TRACE%`` the audit's evidence. The
internal offsets journal topic is not listed either."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from ..log.offset_record import OFFSETS_TOPIC
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import Empty, TopicInfo, TopicList, TopicStatusReply
from ..protocol.requests import CreateTopic, DeleteTopic, GetTopic, ListTopics, TopicStatus
from ..storage.topics import MAX_QUEUES, TopicConfig, check_name
from .fields import Call, Handler, client_written_topic
from .store_errors import as_wire_error

if TYPE_CHECKING:
    from ..protocol.schema import Message
    from ..storage.store import MessageStore
    from .queue_scaler import QueueScaler

log = logging.getLogger("onceq.broker")

class TopicAdmin:
    """``topic_for_write(topic)`` creates a missing topic on first use (when enabled), as
    a send does; ``forget_topic(topic)`` drops a deleted topic from the broker's tables.

    A client's topic creation or deletion does its file work and fsyncs (index
    directories, the commit log up to a new topic's start, the topics table) in threads,
    so that other clients are not held while it runs (a topic created on first use by a
    send writes the table on the loop, as it must before the send is stored)."""

    def __init__(self, store: MessageStore, default_queues: int, *,
                 topic_for_write: Callable[[str], None],
                 forget_topic: Callable[[str], None],
                 off_loop: Callable[..., Awaitable[Any]],
                 log_durable: Callable[[int], Awaitable[None]]) -> None:
        self.store = store
        self.default_queues = default_queues
        self.topic_for_write = topic_for_write
        self.forget_topic = forget_topic
        self.off_loop = off_loop  # runs blocking file work in a thread
        self.log_durable = log_durable  # returns once the commit log is fsynced up to a position
        self._serial = asyncio.Lock()  # one client's topic change at a time, in order
        self._pending = 0  # client topic changes waiting or running
        self._tasks: set[asyncio.Task[None]] = set()
        self.scaling: QueueScaler | None = None  # set by the broker

    def handlers(self) -> dict[type[Message], Handler]:
        return {CreateTopic: self.h_create_topic, DeleteTopic: self.h_delete_topic,
                ListTopics: self.h_list_topics, GetTopic: self.h_get_topic,
                TopicStatus: self.h_topic_status}

    def h_create_topic(self, call: Call, req: CreateTopic) -> TopicInfo | None:
        """A topic already as asked (or a refusal) is answered at once; a new or grown one
        once the topics table is written, in a thread (``_change``)."""
        name = client_written_topic(req.topic)
        if req.follow_group is not None:
            self._later(call, self._change(self._follow, name, req))
            return None
        queues = self.default_queues if req.queues is None else req.queues
        old = self.store.topics.get(name)
        if not self._pending:  # else after the changes that came before it
            if req.exclusive and old is not None:
                raise OnceqError(ErrorCode.TOPIC_EXISTS, f"topic {name!r} already exists")
            if old is not None and queues <= old.queues:
                return self._create(name, queues)  # as it is, or a refused shrink
        self._later(call, self._change(self._grow, name, queues, req.exclusive))
        return None

    def h_delete_topic(self, call: Call, req: DeleteTopic) -> None:
        """The topic is gone when this answers; its index files are removed in a thread."""
        name = client_written_topic(req.topic)
        if not self._pending:  # else it may be a creation waiting its turn
            self.store.get_topic(name)  # no such topic: refused at once
        self._later(call, self._change(self._delete, name))

    def _change(self, change: Callable[..., Awaitable[Message]], *args: Any
                ) -> Coroutine[Any, Any, Message]:
        """One topic creation or deletion of a client, to run after those that came before
        it (``_pending`` counts them from now), so that each writes the table the previous
        one left."""
        self._pending += 1

        async def run() -> Message:
            try:
                async with self._serial:
                    return await change(*args)
            finally:
                self._pending -= 1
        return run()

    async def ensure(self, name: str, queues: int) -> TopicInfo:
        """Create topic ``name`` with ``queues`` queues (or grow it to them), as
        ``CREATE_TOPIC`` does, in turn with the clients' changes (a broker group's leader
        creating a topic its route places here: ``routes.py``)."""
        return await self._change(self._grow, name, queues, False)  # type: ignore[return-value]

    async def _grow(self, name: str, queues: int, exclusive: bool) -> TopicInfo:
        """Create topic ``name`` or grow it: the index directories of its new queues, then
        (a new topic) the commit log durable up to where it starts, then the topics table,
        each in a thread; the topic appears on the loop after them, as ``create`` finds the
        table written."""
        topics = self.store.topics
        check_name("topic", name)
        if not 1 <= queues <= MAX_QUEUES:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                             f"queue count must be 1..{MAX_QUEUES}")
        old = topics.get(name)  # as it is now: a send may have created it meanwhile
        if exclusive and old is not None:
            raise OnceqError(ErrorCode.TOPIC_EXISTS, f"topic {name!r} already exists")
        if old is None or queues > old.queues:
            self.store.gate.check_writable()
            await self.off_loop(topics.make_queue_dirs, name,
                                old.queues if old is not None else 0, queues)
            end = self.store.log.end
            if old is None:
                await self.log_durable(end)
            await self.off_loop(topics.commit_create, name, queues, end)
        return self._create(name, queues)

    def _create(self, name: str, queues: int) -> TopicInfo:
        t = self.store.create_topic(name, queues)
        log.info("topic %s created/updated with %d queues", name, t.queues)
        return topic_info(t)

    async def _follow(self, name: str, req: CreateTopic) -> TopicInfo:
        """Make topic ``name`` (created when missing, with ``min_queues`` queues or the
        count asked) follow ``req.follow_group`` ("": its counts stay as they are)."""
        if self.scaling is None:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "queue scaling is not available")
        group = req.follow_group or None
        if group is not None:
            check_name("group", group)
        old = self.store.topics.get(name)
        lo = 1 if req.min_queues is None else req.min_queues
        hi = req.max_queues
        if hi is None:
            hi = max(lo, old.queues if old is not None else
                     (req.queues or self.default_queues))
        if not 1 <= lo <= hi <= MAX_QUEUES:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, f"queue bounds must be 1 <= min "
                             f"<= max <= {MAX_QUEUES} (got {lo}..{hi})")
        if old is None or (req.queues is not None and req.queues > old.queues):
            await self._grow(name, req.queues or lo, req.exclusive)
        elif req.exclusive:
            raise OnceqError(ErrorCode.TOPIC_EXISTS, f"topic {name!r} already exists")
        t = self.scaling.follow(name, group, lo, hi, req.key_order)
        log.info("topic %s follows group %s: %d..%d queues", name, group, lo, hi)
        return topic_info(t)

    async def _delete(self, name: str) -> Empty:
        self.store.get_topic(name)  # deleted meanwhile: TOPIC_NOT_EXIST
        self.store.gate.check_writable(space=False)  # deleting frees space
        deleting = self.store.topics.deleting
        deleting.add(name)  # no send lands in it (nor auto-creates it) while it goes
        try:
            await self.off_loop(self.store.topics.commit_delete, name)
            aside = self.store.delete_topic(name, keep_files=True)
        finally:
            deleting.discard(name)
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
            except Exception as exc:
                call.fail(as_wire_error(exc))

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
        return topic_info(t)

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
        scaling = None if self.scaling is None else self.scaling.status(topic)
        return TopicStatusReply(topic, queues, scaling)


def topic_info(t: TopicConfig) -> TopicInfo:
    """A topic as ``GET_TOPIC`` and ``CREATE_TOPIC`` answer it: the queues read, and the
    queues written when fewer (a topic that follows a group, ``queue_scaler.py``)."""
    return TopicInfo(t.name, t.readable, t.write_queues)
