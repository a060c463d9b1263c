"""Topics: their names, the topics table (``topics.json``) and each topic's consume queues.

``Topics`` is a read-only map of name -> ``TopicConfig`` that also creates and deletes
topics and holds each topic's consume queues (``queues``, keyed by (topic, queue id)).

A topic's record of ``created_position`` is the commit-log position it was created at: a
record below it belongs to an older topic of the same name (deleted since), so recovery
and reads never take it for this one's. The table is written atomically before anything
changes in memory; a queue's index directory is created before the table names it, and an
index directory of a topic the table does not name is dropped at open.

Each entry of the table is checked at open against the bounds of a topic creation (a valid
name, 1..``MAX_QUEUES`` queues, a position and a time >= 0): an entry out of them is
skipped (logged at ERROR), nothing is created for it, its index directory is left alone and
the entry is kept as it is when the table is written again, for the operator to repair.

A topic whose queues follow a consumer group (``broker/queue_scaling.py``) also keeps its
read and write queue counts (``read_queues``, ``write_queues``: None when all ``queues`` are
read and written) and the broker's scaling state (``scaling``, kept as written); an entry
without them is a topic as older versions wrote it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .consumequeue import ConsumeQueue
from .errors import InvalidArgument, InvalidName, QueueNotFound, TopicNotFound
from .failures import storage_error
from .metadata import RenameNotDurable, load_json, save_json

if TYPE_CHECKING:
    from collections.abc import Callable

    from .commitlog import CommitLog
    from .failures import RateLimitedLog, WriteGate
    from .files import FileOps
    from .openfiles import OpenFiles

log = logging.getLogger("onceq.storage")

NAME_RE = re.compile(r"^[A-Za-z0-9_%|.\-]{1,127}$")
MAX_QUEUES = 1024
DELETED_PREFIX = "#deleted-"  # an index directory moved aside (no topic name has a #)


def check_name(kind: str, name: object) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name in (".", ".."):
        raise InvalidName(
            f"invalid {kind} name {name!r}: use 1-127 of A-Z a-z 0-9 _ - . % |")
    return name


@dataclass(slots=True)
class TopicConfig:
    name: str
    queues: int
    created_position: int  # records before this commit-log position belong to older topics
    created_ms: int
    # queues consumers read and producers write (None: all ``queues``): a topic that
    # follows a consumer group reads and writes fewer while it scales (queue_scaling.py)
    read_queues: int | None = None
    write_queues: int | None = None
    scaling: dict[str, Any] | None = None  # the broker's queue-scaling state, as written

    @property
    def readable(self) -> int:
        """How many queues consumers read (queues 0..readable - 1)."""
        return self.queues if self.read_queues is None else self.read_queues

    @property
    def writable(self) -> int:
        """How many queues producers write (queues 0..writable - 1)."""
        return self.queues if self.write_queues is None else self.write_queues

    @classmethod
    def from_json(cls, name: object, raw: object) -> TopicConfig:
        """An entry of the topics table; ``ValueError`` when it is outside what a topic
        creation accepts (see ``create_topic``)."""
        try:
            check_name("topic", name)
        except InvalidName as exc:
            raise ValueError(exc.message) from None
        assert isinstance(name, str)
        if not isinstance(raw, dict):
            raise ValueError(f"entry {raw!r} is not a map")
        queues, position, ms = (raw.get(k) for k in ("queues", "created_position",
                                                     "created_ms"))
        if not _count(queues) or not 1 <= queues <= MAX_QUEUES:
            raise ValueError(f"queue count {queues!r} is not 1..{MAX_QUEUES}")
        if not _count(position):
            raise ValueError(f"created_position {position!r} is not an integer >= 0")
        if not _count(ms):
            raise ValueError(f"created_ms {ms!r} is not an integer >= 0")
        read, write, scaling = (raw.get(k) for k in ("read_queues", "write_queues",
                                                     "scaling"))
        for key, n in (("read_queues", read), ("write_queues", write)):
            if n is not None and (not _count(n) or not 1 <= n <= queues):
                raise ValueError(f"{key} {n!r} is not 1..{queues}")
        if read is not None and write is not None and write > read:
            raise ValueError(f"write_queues {write} is above read_queues {read}")
        if scaling is not None and not isinstance(scaling, dict):
            raise ValueError(f"scaling {scaling!r} is not a map")
        return cls(name, queues, position, ms, read, write, scaling)

    def to_json(self) -> dict:
        out: dict[str, Any] = {"queues": self.queues,
                               "created_position": self.created_position,
                               "created_ms": self.created_ms}
        if self.read_queues is not None:
            out["read_queues"] = self.read_queues
        if self.write_queues is not None:
            out["write_queues"] = self.write_queues
        if self.scaling is not None:
            out["scaling"] = self.scaling
        return out


def _count(value: object) -> bool:
    """An integer >= 0 (JSON ``true`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _merge_topic(table: dict[str, TopicConfig], t: TopicConfig
                 ) -> dict[str, TopicConfig] | None:
    """``table`` with topic ``t`` in it: added, or grown to its queue count keeping the
    creation it has; None when ``table`` has it with as many queues already."""
    cur = table.get(t.name)
    if cur is not None and cur.queues >= t.queues:
        return None
    table[t.name] = t if cur is None else replace(cur, queues=t.queues)
    return table


def load_topics_table(path: str, files: FileOps) -> tuple[dict[str, TopicConfig],
                                                          dict[str, Any]]:
    """The topics of the table at ``path`` that pass the checks of a topic creation, and
    the raw entries that do not (each logged at ERROR, naming the file and the entry).
    Raises ``ValueError`` when the file is not a JSON map."""
    raw = load_json(path, {}, files)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the topics table is not a map")
    topics: dict[str, TopicConfig] = {}
    skipped: dict[str, Any] = {}
    for name, entry in raw.items():
        try:
            topics[name] = TopicConfig.from_json(name, entry)
        except ValueError as exc:
            log.error("store: %s: topic %r skipped: %s; nothing is created for it and its "
                      "index files are kept until the entry is repaired", path, name, exc)
            skipped[name] = entry
    return topics, skipped


class Topics(Mapping[str, TopicConfig]):
    """The topics (name -> ``TopicConfig``, read-only as a map), the topics table at
    ``path``, and the consume queues of each topic (``queues``) under ``queues_dir``.

    ``queues``: the (empty) map of consume queues to fill, shared with whoever rolls them
    back; ``log``: where a new topic's creation position comes from; ``gate``: whether
    writes are accepted (a table that cannot be restored stops them)."""

    def __init__(self, path: str, queues_dir: str,
                 queues: dict[tuple[str, int], ConsumeQueue], index_entries_per_file: int,
                 files: FileOps, open_files: OpenFiles, clock: Callable[[], float],
                 log_: CommitLog, gate: WriteGate, errors: RateLimitedLog) -> None:
        self.path = path
        self.queues_dir = queues_dir
        # topics whose delete is being made durable: sends to them are refused meanwhile
        self.deleting: set[str] = set()
        self.index_entries_per_file = index_entries_per_file
        self.files = files
        self.open_files = open_files
        self.clock = clock
        self.log = log_
        self.gate = gate
        self.errors = errors
        self._topics: dict[str, TopicConfig] = {}
        # the table as written: ahead of ``_topics`` while a change written off the event
        # loop waits to be applied there; written under ``_write_lock`` from any thread
        self._durable: dict[str, TopicConfig] = {}
        self._write_lock = threading.Lock()
        self.queues = queues
        # entries of the table that failed the checks at open, written back as they are
        self.skipped: dict[str, Any] = {}

    # ------------------------------------------------------------------ the map
    def __getitem__(self, name: str) -> TopicConfig:
        return self._topics[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._topics)

    def __len__(self) -> int:
        return len(self._topics)

    def __contains__(self, name: object) -> bool:
        return name in self._topics

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return self._topics.get(name, default)

    def lookup(self, name: str) -> TopicConfig:
        """The topic ``name``; ``TopicNotFound`` (``InvalidName`` for a bad name)."""
        t = self._topics.get(name)
        if t is None:
            check_name("topic", name)
            raise TopicNotFound(f"topic {name!r} does not exist")
        return t

    def queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        """The consume queue ``queue_id`` of ``topic``; ``QueueNotFound`` when the topic
        has no such queue (``TopicNotFound`` when there is no such topic)."""
        cq = self.queues.get((topic, queue_id))
        if cq is None:
            t = self.lookup(topic)
            raise QueueNotFound(
                f"queue {queue_id!r} out of range for topic {topic!r} ({t.queues} queues)")
        return cq

    def positions(self) -> dict[str, int]:
        """name -> creation position of every topic."""
        return {n: t.created_position for n, t in self._topics.items()}

    # ------------------------------------------------------------------ changes
    def set_layout(self, name: str, read: int | None, write: int | None,
                   scaling: dict[str, Any] | None) -> TopicConfig:
        """Set the read and write queue counts of topic ``name`` (None: all its queues) and
        its scaling state; written to the table (on the calling thread) before it changes
        in memory. ``InvalidArgument`` when a count is outside 1..queues or write > read."""
        t = self.lookup(name)
        for n in (read, write):
            if n is not None and not 1 <= n <= t.queues:
                raise InvalidArgument(f"a read or write queue count must be 1..{t.queues}")
        if (read if read is not None else t.queues) < (write if write is not None
                                                        else t.queues):
            raise InvalidArgument("a topic cannot write more queues than it reads")
        self.gate.check_writable(space=False)

        def change(table: dict[str, TopicConfig]) -> dict[str, TopicConfig] | None:
            cur = table.get(name)
            if cur is None:  # deleted meanwhile
                return None
            table[name] = replace(cur, read_queues=read, write_queues=write, scaling=scaling)
            return table

        try:
            self._commit(change)
        except OSError as exc:
            self.errors.error("topics", "store: cannot change topic %s: %s", name, exc)
            raise storage_error(exc, f"topic {name!r} was not changed") from None
        new = self._topics[name] = replace(self._topics[name], read_queues=read,
                                           write_queues=write, scaling=scaling)
        return new

    def create(self, name: str, queues: int) -> TopicConfig:
        """Create topic ``name`` with ``queues`` queues, or grow it to that many.

        When the durable table already names the topic with at least that many queues
        (``commit_create`` wrote it, off the event loop), nothing is written: only the
        consume queues are opened and the topic appears in memory."""
        check_name("topic", name)
        if not isinstance(queues, int) or not 1 <= queues <= MAX_QUEUES:
            raise InvalidArgument(f"queue count must be 1..{MAX_QUEUES}")
        old = self._topics.get(name)
        if old is not None:
            if queues < old.queues:
                raise InvalidArgument(
                    f"topic {name!r} has {old.queues} queues; the count cannot shrink")
            if queues == old.queues:
                return old
        self.gate.check_writable()
        written = self._durable.get(name)
        first = old.queues if old is not None else 0
        new: dict[int, ConsumeQueue] = {}
        try:
            if written is not None and written.queues >= queues:
                t = written
            elif old is not None:
                t = replace(old, queues=queues)
            else:
                # the log must be durable up to created_position first: a log that ended
                # below it after a power loss would make the new topic's records look like
                # an old topic's
                self.gate.sync_log()
                t = TopicConfig(name, queues, self.log.end, int(self.clock() * 1000))
            # index directories first: left over after a failure, the next open drops them
            for qid in range(first, t.queues):
                cq = new[qid] = self._consume_queue(name, qid)
                cq.load()
                cq.reset(0)
            # the table is durable before anything changes in memory; what is written is
            # the durable table with this topic merged in (another writer may have grown it)
            t = self._commit(lambda table: _merge_topic(table, t)).get(name, t)
            for qid in range(first + len(new), t.queues):  # grown meanwhile: made by it
                cq = new[qid] = self._consume_queue(name, qid)
                cq.load()
        except OSError as exc:
            for cq in new.values():
                cq.close()
            # never the directories of queues the durable table names
            kept = self._durable.get(name)
            if kept is None:
                self.files.rmtree(os.path.join(self.queues_dir, name))
            else:
                for qid, cq in new.items():
                    if qid >= kept.queues:
                        self.files.rmtree(cq.dir)
            err = storage_error(exc, f"topic {name!r} was not created")
            self.errors.error("topics", "store: cannot create topic %s: %s", name, exc)
            raise err from None
        for qid, cq in new.items():
            self.queues[(name, qid)] = cq
        self._topics[name] = t
        self.skipped.pop(name, None)  # replaced by the new topic
        return t

    def commit_create(self, name: str, queues: int, log_end: int) -> None:
        """Write the durable table with topic ``name`` created (at commit-log position
        ``log_end``, up to which the caller made the log durable) or grown to ``queues``
        queues; nothing changes in memory: ``create`` does that next, on the event loop,
        without writing again. Any thread; the queues' index directories must exist
        (``make_queue_dirs``)."""
        check_name("topic", name)
        t = TopicConfig(name, queues, log_end, int(self.clock() * 1000))
        try:
            self._commit(lambda table: _merge_topic(table, t))
        except OSError as exc:
            self.errors.error("topics", "store: cannot create topic %s: %s", name, exc)
            raise storage_error(exc, f"topic {name!r} was not created") from None

    def commit_delete(self, name: str) -> None:
        """Write the durable table without topic ``name``; ``delete`` then drops it from
        memory without writing again. Any thread."""
        try:
            self._commit(lambda table: table if table.pop(name, None) else None)
        except OSError as exc:
            self.errors.error("topics", "store: cannot delete topic %s: %s", name, exc)
            raise storage_error(exc, f"topic {name!r} was not deleted") from None

    def make_queue_dirs(self, name: str, first: int, end: int) -> None:
        """Create the index directories of queues ``first``..``end - 1`` of topic ``name``
        ahead of ``create`` (which then finds them): file work only, no state, so it may run
        off the event loop (a thousand directories take a good part of a second). Left
        over when the topic is not created, the next open drops them. Best effort: a
        directory it could not make (the topic deleted meanwhile, a full disk) is made, or
        its error reported, by ``create``."""
        check_name("topic", name)
        if not 0 <= first <= end <= MAX_QUEUES:
            raise InvalidArgument(f"queue count must be 1..{MAX_QUEUES}")
        try:
            for qid in range(first, end):
                self.files.makedirs(self._queue_dir(name, qid))
        except OSError as exc:
            log.debug("store: index directories of topic %s made ahead: %s", name, exc)

    def delete(self, name: str, *, keep_files: bool = False) -> str | None:
        """Delete topic ``name`` and its consume queues (its dedup keys and offsets are the
        caller's to drop). With ``keep_files`` the index directory is only moved aside, and
        its path returned for the caller to remove (off the event loop); the next open
        drops it if that never happens."""
        t = self.lookup(name)
        self.gate.check_writable(space=False)  # deleting frees space: allowed on a full disk
        self.commit_delete(name)  # nothing to write after ``commit_delete`` in a thread
        del self._topics[name]
        directory = os.path.join(self.queues_dir, name)
        if keep_files:
            for qid in range(t.queues):
                self.queues.pop((name, qid)).close()
            aside = os.path.join(self.queues_dir, f"{DELETED_PREFIX}{name}-{time.time_ns()}")
            try:
                self.files.replace(directory, aside)
                return aside
            except OSError as exc:  # the next open drops the directory of an unknown topic
                log.warning("store: index files of deleted topic %s: %s", name, exc)
                return None
        for qid in range(t.queues):
            try:
                self.queues.pop((name, qid)).destroy()
            except OSError as exc:  # the next open drops the directory of an unknown topic
                log.warning("store: index files of deleted topic %s: %s", name, exc)
        self.files.rmtree(directory)
        return None

    # ------------------------------------------------------------------ open
    def load(self) -> None:
        """Load the topics table (rebuilt from the index directories when unreadable)."""
        try:
            topics, self.skipped = load_topics_table(self.path, self.files)
        except ValueError as exc:
            log.error("store: %s; the topics are rebuilt from the index directories", exc)
            topics = self._topics_from_index_dirs()
            log.error("store: topics rebuilt from the index directories: %s",
                      ", ".join(f"{t.name} ({t.queues} queues)" for t in topics.values())
                      or "none")
            try:
                self._save_topics(topics)
            except OSError as save_exc:  # rebuilt again at the next start
                log.error("store: cannot save the rebuilt topics table: %s", save_exc)
        self._topics.update(topics)
        self._durable = dict(topics)

    def _topics_from_index_dirs(self) -> dict[str, TopicConfig]:
        """The topics table as the index directories show it: one topic per directory
        with a valid name, queues 0..n-1 from its queue directories. A topic's creation
        position is its first indexed record's (0 when its index holds none), so records
        of an older topic of the same name stay apart."""
        topics: dict[str, TopicConfig] = {}
        now_ms = int(self.clock() * 1000)
        for name in sorted(self.files.listdir(self.queues_dir)):
            try:
                check_name("topic", name)
                qids = set(self.files.listdir(os.path.join(self.queues_dir, name)))
            except (InvalidName, OSError):
                continue
            queues = 0
            while queues < MAX_QUEUES and str(queues) in qids:
                queues += 1
            if not queues:
                continue
            first: list[int] = []
            for qid in range(queues):
                cq = self._consume_queue(name, qid)
                try:
                    cq.load()
                    if cq.max_offset > cq.min_offset:
                        pos, size, _th, _ts = cq.entry(cq.min_offset)
                        if size:
                            first.append(pos)
                except (OSError, KeyError):
                    pass
                finally:
                    cq.close()
            topics[name] = TopicConfig(name, queues, min(first, default=0), now_ms)
        return topics

    def _save_topics(self, table: dict[str, TopicConfig]) -> None:
        """Write ``table`` as the topics table, with the skipped entries that no topic of
        ``table`` replaces."""
        # a copy taken at once: this may run in a thread while the loop drops an entry
        out = {n: e for n, e in list(self.skipped.items()) if n not in table}
        out.update((n, t.to_json()) for n, t in table.items())
        save_json(self.path, out, self.files)

    def _commit(self, change: Callable[[dict[str, TopicConfig]],
                                       dict[str, TopicConfig] | None]
                ) -> dict[str, TopicConfig]:
        """Make ``change(a copy of the durable table)`` the durable topics table (nothing
        is written when it returns None: no change), or raise with the old one in place;
        the durable table after it. Writes are serialised, from any thread.

        When the rename went through but its directory fsync failed, the old table is
        written back, and when even that fails the store stops writing (a restart reads
        whichever is there)."""
        with self._write_lock:
            old = self._durable
            table = change(dict(old))
            if table is None:
                return old
            try:
                self._save_topics(table)
            except RenameNotDurable as exc:
                try:
                    self._save_topics(old)
                except OSError as again:
                    self.gate.stop(f"the topics table cannot be restored: {again}")
                raise exc from None
            self._durable = table
            return table

    def _queue_dir(self, topic: str, qid: int) -> str:
        return os.path.join(self.queues_dir, topic, str(qid))

    def _consume_queue(self, topic: str, qid: int) -> ConsumeQueue:
        """The consume queue of ``qid`` of ``topic``, not loaded yet."""
        return ConsumeQueue(self._queue_dir(topic, qid), self.index_entries_per_file,
                            self.open_files)

    def open_queues(self, checkpoint: int | None, ends: dict[str, int] | None) -> bool:
        """Load every topic's consume queues, and drop the index directories of unknown
        topics; True when an index file was lost or cut below what the checkpoint
        (``checkpoint``, queue ends ``ends``) counted: the indexes are then rebuilt."""
        lost_index = False
        for name, t in self._topics.items():
            for qid in range(t.queues):
                try:
                    self.files.listdir(self._queue_dir(name, qid))
                except FileNotFoundError:
                    # an index that vanished while the log may hold its records
                    lost_index = lost_index or checkpoint is None or (
                        t.created_position < checkpoint)
                cq = self._consume_queue(name, qid)
                cq.load()
                self.queues[(name, qid)] = cq
                # entries lost before kept ones, or fewer entries than the checkpoint
                # counted: an index file was cut or lost. Entries past that count may be
                # missing after a power cut (no checkpoint fsynced them yet): the tail scan
                # rebuilds them. Without the counts, any lost last entry may have been
                # below the checkpoint.
                lost_index = lost_index or cq.lost_entries or (
                    cq.lost_tail if ends is None
                    else cq.max_offset < ends.get(f"{name}/{qid}", 0))
        for name in self.files.listdir(self.queues_dir):
            if name not in self._topics and name not in self.skipped:
                self.files.rmtree(os.path.join(self.queues_dir, name))
        return lost_index

    def move_back(self) -> None:
        """Topic creation positions beyond the recovered log end are moved back to it.

        Otherwise the records the topic receives next, written from the log end, would lie
        below its creation position and be taken for an older topic's after a restart.
        """
        end = self.log.end
        moved = [t for t in self._topics.values() if t.created_position > end]
        for t in moved:
            log.error("store: topic %s was created at position %d, beyond the recovered log "
                      "end %d; moved back", t.name, t.created_position, end)
            t.created_position = end
        if moved:
            try:
                self._save_topics(self._durable)
            except OSError as exc:  # moved back again at the next start
                log.error("store: cannot save the moved topics: %s", exc)

