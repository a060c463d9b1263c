"""Consumer offsets: a table in memory, journaled in the commit log, snapshotted to a file.

Every change of a committed offset is appended to the commit log as a record of the
internal topic ``%OFFSETS%`` (see ``log/offset_record.py``) before the commit is answered,
so an offset is exactly as durable as a message stored at that moment under the flush
policy: ``sync`` answers after the fsync that covers it (sharing it with concurrent sends
and commits), ``async`` once it is in the page cache (a killed process loses nothing).

``offsets.json`` is a snapshot of the table that records how many ``%OFFSETS%`` records it
covers. At open the snapshot is loaded and the records after it are replayed; retention
never deletes a segment holding a record the last written snapshot does not cover.

Commits carried by pulls are not answered on their own: they are set at once and journaled
together by ``flush_pending`` (the broker calls it every ``offsets_journal_ms``, 100 ms, and
before any explicit commit), one record per changed queue, so a consumer committing on every
pull does not pay a log write per pull. A consumer re-sends its finished offsets after a
reconnect, which covers the interval a crash may lose. A deleted group's offsets go with
a deletion record of their own, replayed in its place.

``ConsumerOffsets`` holds the table; it writes its journal records through the append
function it is handed (a put to ``%OFFSETS%``) and reads them back at open through the read
function it is handed. Commits and queries are checked against the queues of ``topics`` and
the group names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..log.offset_record import (
    OFFSETS_TOPIC,
    GroupDeleted,
    OffsetCommit,
    OffsetRecordError,
    Offsets,
    commit_part,
    decode_offset_record,
    decode_snapshot,
    encode_snapshot,
)
from ..log.record import RecordError, decode_records
from .errors import InvalidName, StorageError
from .metadata import load_json, write_atomic
from .reads import GetResult, ReadStatus
from .topics import check_name

if TYPE_CHECKING:
    from .failures import RateLimitedLog, WriteGate
    from .files import FileOps
    from .topics import Topics

log = logging.getLogger("onceq.storage")

REPLAY_BATCH = 1024


# the journal's writer: message parts to append to %OFFSETS% -> commit-log end after them
AppendRecords = Callable[[list[bytes]], int]
# the journal's reader: (offset, max records) -> the records of %OFFSETS% from there
ReadRecords = Callable[[int, int], GetResult]


class ConsumerOffsets:
    """The committed offsets (``groups``: ``group -> topic -> "queue" -> offset``), their
    snapshot file at ``path`` and their journal, written with ``append`` and read back with
    ``read``."""

    def __init__(self, path: str, files: FileOps, topics: Topics, append: AppendRecords,
                 read: ReadRecords, gate: WriteGate, clock: Callable[[], float],
                 errors: RateLimitedLog) -> None:
        self.path = path
        self.files = files
        self.topics = topics
        self.append = append
        self.read = read
        self.gate = gate
        self.clock = clock
        self.errors = errors
        self.groups: Offsets = {}
        self.dirty = False
        self.covered = 0  # %OFFSETS% records covered by the last snapshot written
        self.replayed = 0  # records applied at open
        self.last_end = 0  # commit-log end after the last offset record written
        self._pending: dict[tuple[str, str, int], int] = {}  # set, not journaled yet

    # ------------------------------------------------------------------ queries
    def get(self, group: str, topic: str, queue_id: int) -> int:
        """The committed offset, or -1 when the group has none for this queue."""
        self.topics.queue(topic, queue_id)
        return self._get(group, topic, queue_id)

    def _get(self, group: str, topic: str, queue_id: int) -> int:
        return self.groups.get(group, {}).get(topic, {}).get(str(queue_id), -1)

    def journal_end(self) -> int:
        """How many ``%OFFSETS%`` records exist (the offset the next one gets)."""
        cq = self.topics.queues.get((OFFSETS_TOPIC, 0))
        return 0 if cq is None else cq.max_offset

    # ------------------------------------------------------------------ changes
    def commit(self, group: str, topic: str, queue_id: int, offset: int) -> int:
        """Commit a group's offset; it is journaled in the commit log when it changed.

        Returns the commit-log position the commit is durable at once the log is fsynced
        up to it (a sync-flush broker answers after that; it covers an unchanged offset's
        earlier record).

        Offset commits go on when the store cannot write (a full disk, writes stopped after
        a failure): the offset is then kept in memory and in the next snapshot only, as the
        journal record could not be written (0 is returned: nothing to wait for)."""
        self.topics.queue(topic, queue_id)
        check_name("group", group)
        offset = int(offset)
        key = (group, topic, queue_id)
        if self._get(group, topic, queue_id) == offset and key not in self._pending:
            # writes stopped after a failure: its record may have been removed, and nothing
            # will be fsynced any more: in memory and the snapshot is all there is
            return 0 if self.gate.write_failure is not None else self.last_end
        self._pending[key] = offset
        self._set(group, topic, queue_id, offset)
        return self.flush_pending()

    def commit_later(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Commit a group's offset now and journal it with the next ``flush_pending`` (a
        commit carried by a pull: nobody waits for its durability)."""
        self.topics.queue(topic, queue_id)
        check_name("group", group)
        offset = int(offset)
        if self._get(group, topic, queue_id) != offset:
            self._pending[(group, topic, queue_id)] = offset
            self._set(group, topic, queue_id, offset)

    def flush_pending(self) -> int:
        """Journal the offsets set since the last call in one write; return the commit-log
        position they are durable at once fsynced (0: not journaled, see ``commit``)."""
        if not self._pending:
            return self.last_end
        pending, self._pending = self._pending, {}
        if self.gate.write_failure is not None:
            return 0
        try:
            now_ms = int(self.clock() * 1000)
            parts = [commit_part(OffsetCommit(g, t, q, off), now_ms)
                     for (g, t, q), off in pending.items()]
            self.last_end = self.append(parts)
        except StorageError as exc:
            if not exc.retriable:
                raise
            self.errors.warning("offsets", "offsets: commits are kept in memory and "
                                "in the snapshot only, the journal write failed: %s",
                                exc.message)
            return 0
        return self.last_end

    def delete_group(self, group: str) -> tuple[int, int]:
        """Forget every offset of ``group`` (a later commit starts it again): a deletion
        record is journaled first, so that a restart or a new leader replays it; returns
        (queues forgotten, the commit-log position it is durable at once fsynced). Raises
        the store's error when the record cannot be written (the group then stays)."""
        check_name("group", group)
        self.flush_pending()  # (commits of before: the deletion comes after them)
        self.gate.check_writable()
        self.last_end = self.append([commit_part(GroupDeleted(group),
                                                 int(self.clock() * 1000))])
        topics = self.groups.pop(group, {})
        self.dirty = True
        return sum(len(qs) for qs in topics.values()), self.last_end

    def _set(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        self.groups.setdefault(group, {}).setdefault(topic, {})[str(queue_id)] = offset
        self.dirty = True

    def drop_topic(self, topic: str) -> None:
        """A deleted topic's offsets go (its journal records are skipped at replay: they
        lie before a re-created topic's creation position)."""
        for g in self.groups.values():
            g.pop(topic, None)
        self.dirty = True

    # ------------------------------------------------------------------ snapshot
    def snapshot(self) -> tuple[Offsets, int] | None:
        """(a copy of the offsets, journal records it covers) if the offsets changed since
        the last snapshot, else None. Pass both to ``write``, which encodes them: the copy
        is taken on the loop (one dict copy per group and topic), the encoding is not.

        A caller whose write of the snapshot fails calls ``changed`` to retry later."""
        if not self.dirty:
            return None
        self.dirty = False
        groups = {g: {t: dict(qs) for t, qs in topics.items()}
                  for g, topics in self.groups.items()}
        return groups, self.journal_end()

    def changed(self) -> None:
        self.dirty = True

    def write(self, groups: Offsets, covered: int) -> None:
        """Encode and write an offsets snapshot (safe to run off the loop: the encoder is
        the pure-Python one, which lets the loop run between its steps)."""
        write_atomic(self.path, encode_snapshot(groups, covered), self.files)
        self.covered = max(self.covered, covered)

    def save(self) -> None:
        snap = self.snapshot()
        if snap is not None:
            self.write(*snap)

    def retention_floor(self) -> int | None:
        """Commit-log position of the first record no written snapshot covers (segments
        from there on must be kept), or None."""
        cq = self.topics.queues.get((OFFSETS_TOPIC, 0))
        if cq is None or self.covered >= cq.max_offset:
            return None
        return cq.entry(max(self.covered, cq.min_offset))[0]

    # ------------------------------------------------------------------ open
    def load(self) -> bool:
        """Load the offsets snapshot; False when it is damaged (logged at ERROR): the
        offsets are then rebuilt from their whole journal (``open``)."""
        try:
            self._load(load_json(self.path, None, self.files))
        except ValueError as exc:
            msg = str(exc)
            if self.path not in msg:
                msg = f"{self.path}: {msg}"
            log.error("offsets: %s; the offsets are rebuilt from their journal in the "
                      "commit log", msg)
            return False
        return True

    def _load(self, raw: object) -> None:
        """The parsed ``offsets.json`` (None when missing); raises ``ValueError`` when it
        is not a snapshot whose names and offsets a commit could have written."""
        if raw is None:
            return
        groups, covered = decode_snapshot(raw)
        try:
            for g, topics in groups.items():
                check_name("group", g)
                for t in topics:
                    check_name("topic", t)
        except InvalidName as exc:
            raise ValueError(f"malformed offsets snapshot: {exc.message}") from None
        self.groups, self.covered = groups, covered

    def open(self, rewrite: bool = False) -> None:
        """Replay the offset commits after the snapshot; offsets beyond a recovered queue
        end move back to it. The snapshot is written now when either changed the past, or
        when ``rewrite`` (the snapshot was damaged)."""
        if self._replay() | self._clamp_to_queue_ends() | rewrite:
            self.dirty = True
            try:
                self.save()
            except OSError as exc:  # written by the periodic save or at close
                self.dirty = True
                log.error("store: cannot save the consumer offsets at start: %s", exc)

    def _replay(self) -> bool:
        """Apply the journal records after the snapshot; True when a snapshot must be
        written now (the log ended below what the snapshot covers)."""
        cq = self.topics.queues.get((OFFSETS_TOPIC, 0))
        if cq is None:
            return False
        if cq.max_offset < self.covered:
            # the log lost records the snapshot already holds (a power cut in async mode):
            # the next records would reuse their offsets and be skipped by the next replay
            log.warning("offsets: the journal ends at %d, below the %d records the snapshot "
                        "covers; the snapshot is written again", cq.max_offset, self.covered)
            self.covered = cq.max_offset
            return True
        offset = self.covered
        if offset < cq.min_offset:
            log.error("offsets: journal records %d..%d are gone (retention); offsets "
                      "committed then are lost", offset, cq.min_offset - 1)
            offset = cq.min_offset
        while offset < cq.max_offset:
            r = self.read(offset, REPLAY_BATCH)
            if r.status == ReadStatus.FOUND:
                try:
                    for m in decode_records(r.payload, True, offset, r.next_offset):
                        self._apply(m.body, m.position, m.queue_offset)
                except RecordError as exc:  # checked on read: not expected
                    log.error("offsets: journal record unreadable: %s", exc)
            elif r.status == ReadStatus.DAMAGED:
                log.error("offsets: journal records %d..%d are damaged; offsets committed "
                          "then are lost", offset, r.next_offset - 1)
            if r.next_offset <= offset:
                break
            offset = r.next_offset
        return False

    def _apply(self, body: bytes, position: int, journal_offset: int) -> None:
        try:
            c = decode_offset_record(body)
        except OffsetRecordError as exc:
            log.error("offsets: journal record %d: %s; skipped", journal_offset, exc)
            return
        if isinstance(c, GroupDeleted):
            self.groups.pop(c.group, None)
            self.replayed += 1
            return
        t = self.topics.get(c.topic)
        if t is None or position < t.created_position or c.queue_id >= t.queues:
            return  # a deleted topic (or an older one of the same name)
        self._set(c.group, c.topic, c.queue_id, c.offset)
        self.replayed += 1

    def _clamp_to_queue_ends(self) -> bool:
        """Offsets beyond their queue's end (the log was cut by recovery) move back to the
        end, so the next messages stored there are delivered, not skipped. True if any."""
        moved = False
        for group, topics in self.groups.items():
            for topic, qs in topics.items():
                for q, off in qs.items():
                    cq = self.topics.queues.get((topic, int(q)))
                    if cq is not None and off > cq.max_offset:
                        log.error("offsets: group %s committed %d on %s queue %s, beyond the "
                                  "recovered queue end %d; moved back to it", group, off,
                                  topic, q, cq.max_offset)
                        qs[q] = cq.max_offset
                        moved = True
        if moved:
            self.dirty = True
        return moved

