"""Topics: their names, the topics table (``topics.json``) and each topic's consume queues.

A topic's record of ``created_position`` is the commit-log position it was created at: a
record below it belongs to an older topic of the same name (deleted since), so recovery
and reads never take it for this one's. The table is written atomically before anything
changes in memory; a queue's index directory is created before the table names it, and an
index directory of a topic the table does not name is dropped at open.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..protocol.errors import ErrorCode, OnceqError
from .consumequeue import ConsumeQueue
from .failures import storage_error
from .metadata import RenameNotDurable, load_json, save_json

if TYPE_CHECKING:
    from .config import StoreConfig
    from .files import FileOps

log = logging.getLogger("onceq.storage")

NAME_RE = re.compile(r"^[A-Za-z0-9_%|.\-]{1,127}$")
MAX_QUEUES = 1024


def check_name(kind: str, name: object) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name in (".", ".."):
        raise OnceqError(
            ErrorCode.INVALID_NAME,
            f"invalid {kind} name {name!r}: use 1-127 of A-Z a-z 0-9 _ - . % |",
        )
    return name


@dataclass(slots=True)
class TopicConfig:
    name: str
    queues: int
    created_position: int  # records before this commit-log position belong to older topics
    created_ms: int

    @classmethod
    def from_json(cls, name: str, raw: dict) -> TopicConfig:
        return cls(name, int(raw["queues"]), int(raw["created_position"]),
                   int(raw["created_ms"]))

    def to_json(self) -> dict:
        return {"queues": self.queues, "created_position": self.created_position,
                "created_ms": self.created_ms}


class Topics:
    """The topic operations of ``MessageStore``: create, delete, look up; the topics table
    and the consume queues of each topic (``queues``)."""

    config: StoreConfig
    files: FileOps
    topics: dict[str, TopicConfig]
    queues: dict[tuple[str, int], ConsumeQueue]

    def create_topic(self, name: str, queues: int) -> TopicConfig:
        check_name("topic", name)
        if not isinstance(queues, int) or not 1 <= queues <= MAX_QUEUES:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, f"queue count must be 1..{MAX_QUEUES}")
        old = self.topics.get(name)
        if old is not None:
            if queues < old.queues:
                raise OnceqError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"topic {name!r} has {old.queues} queues; the count cannot shrink",
                )
            if queues == old.queues:
                return old
        self.check_writable()
        new: list[ConsumeQueue] = []
        try:
            if old is not None:
                t = TopicConfig(name, queues, old.created_position, old.created_ms)
            else:
                # the log must be durable up to created_position first: a log that ended
                # below it after a power loss would make the new topic's records look like
                # an old topic's
                self.sync_log()
                t = TopicConfig(name, queues, self.log.end, int(self.clock() * 1000))
            # index directories first: left over after a failure, the next open drops them
            for qid in range(old.queues if old else 0, queues):
                cq = self._consume_queue(name, qid)
                new.append(cq)
                cq.load()
                cq.reset(0)
            # the table is durable before anything changes in memory
            self._write_topics({**self.topics, name: t})
        except OSError as exc:
            for cq in new:
                cq.close()
            if old is None:
                self.files.rmtree(os.path.join(self._queues_dir, name))
            else:
                for cq in new:
                    self.files.rmtree(cq.dir)
            err = storage_error(exc, f"topic {name!r} was not created")
            self.errors.error("topics", "store: cannot create topic %s: %s", name, exc)
            raise err from None
        for qid, cq in enumerate(new, start=old.queues if old else 0):
            self.queues[(name, qid)] = cq
        self.topics[name] = t
        return t

    def delete_topic(self, name: str) -> None:
        t = self.get_topic(name)
        self.check_writable(space=False)  # deleting frees space: allowed on a full disk
        table = {n: v for n, v in self.topics.items() if n != name}
        try:
            self._write_topics(table)
        except OSError as exc:
            self.errors.error("topics", "store: cannot delete topic %s: %s", name, exc)
            raise storage_error(exc, f"topic {name!r} was not deleted") from None
        del self.topics[name]
        for qid in range(t.queues):
            try:
                self.queues.pop((name, qid)).destroy()
            except OSError as exc:  # the next open drops the directory of an unknown topic
                log.warning("store: index files of deleted topic %s: %s", name, exc)
        self.files.rmtree(os.path.join(self._queues_dir, name))
        self.dedup.drop_topic(name)
        self.offset_table.drop_topic(name)

    def get_topic(self, name: str) -> TopicConfig:
        t = self.topics.get(name)
        if t is None:
            check_name("topic", name)
            raise OnceqError(ErrorCode.TOPIC_NOT_EXIST, f"topic {name!r} does not exist")
        return t

    def _load_topics(self) -> None:
        for name, t in load_json(self._topics_path, {}, self.files).items():
            self.topics[name] = TopicConfig.from_json(name, t)

    def _save_topics(self, table: dict[str, TopicConfig] | None = None) -> None:
        """Write ``table`` (None: the topics in memory) as the topics table."""
        table = self.topics if table is None else table
        save_json(self._topics_path, {n: t.to_json() for n, t in table.items()}, self.files)

    def _write_topics(self, table: dict[str, TopicConfig]) -> None:
        """Make ``table`` the durable topics table, or raise with the old one in place.

        When the rename went through but its directory fsync failed, the new table is
        visible on disk while memory keeps the old one: the old table is written back, and
        when even that fails the store stops writing (a restart reads whichever is there).
        """
        try:
            self._save_topics(table)
        except RenameNotDurable as exc:
            try:
                self._save_topics()
            except OSError as again:
                self._fail_stop(f"the topics table cannot be restored: {again}")
            raise exc from None

    def _queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        cq = self.queues.get((topic, queue_id))
        if cq is None:
            t = self.get_topic(topic)
            raise OnceqError(
                ErrorCode.INVALID_QUEUE,
                f"queue {queue_id!r} out of range for topic {topic!r} ({t.queues} queues)",
            )
        return cq

    def _queue_dir(self, topic: str, qid: int) -> str:
        return os.path.join(self._queues_dir, topic, str(qid))

    def _consume_queue(self, topic: str, qid: int) -> ConsumeQueue:
        """The consume queue of ``qid`` of ``topic``, not loaded yet."""
        return ConsumeQueue(self._queue_dir(topic, qid), self.config.index_entries_per_file,
                            self.open_files)

    def _open_queue(self, topic: str, qid: int) -> ConsumeQueue:
        cq = self._consume_queue(topic, qid)
        cq.load()
        self.queues[(topic, qid)] = cq
        return cq

    def _drop_unknown_queue_dirs(self) -> None:
        for name in self.files.listdir(self._queues_dir):
            if name not in self.topics:
                self.files.rmtree(os.path.join(self._queues_dir, name))

    def _move_back_topics(self) -> None:
        """Topic creation positions beyond the recovered log end are moved back to it.

        Otherwise the records the topic receives next, written from the log end, would lie
        below its creation position and be taken for an older topic's after a restart.
        """
        end = self.log.end
        moved = [t for t in self.topics.values() if t.created_position > end]
        for t in moved:
            log.error("store: topic %s was created at position %d, beyond the recovered log "
                      "end %d; moved back", t.name, t.created_position, end)
            t.created_position = end
        if moved:
            try:
                self._save_topics()
            except OSError as exc:  # moved back again at the next start
                log.error("store: cannot save the moved topics: %s", exc)

    def _topic_positions(self) -> dict[str, int]:
        return {n: t.created_position for n, t in self.topics.items()}
