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
reconnect, which covers the interval a crash may lose.

``ConsumerOffsets`` is the store's side: commits and queries of ``MessageStore``, checked
against its queues and group names.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..log.offset_record import (
    OFFSETS_TOPIC,
    OffsetCommit,
    OffsetRecordError,
    Offsets,
    commit_part,
    decode_commit,
    decode_snapshot,
    encode_snapshot,
)
from ..log.record import RecordError, decode_records
from ..protocol.codes import PullStatus
from ..protocol.errors import OnceqError
from .metadata import load_json, write_atomic
from .topics import check_name

if TYPE_CHECKING:
    from .store import MessageStore

log = logging.getLogger("onceq.storage")

REPLAY_BATCH = 1024


class OffsetTable:
    """The committed offsets of a store (``group -> topic -> "queue" -> offset``)."""

    def __init__(self, store: MessageStore) -> None:
        self.store = store
        self.groups: Offsets = {}
        self.dirty = False
        self.covered = 0  # %OFFSETS% records covered by the last snapshot written
        self.replayed = 0  # records applied at open
        self.last_end = 0  # commit-log end after the last offset record written
        self._pending: dict[tuple[str, str, int], int] = {}  # set, not journaled yet

    # ------------------------------------------------------------------ queries
    def get(self, group: str, topic: str, queue_id: int) -> int:
        return self.groups.get(group, {}).get(topic, {}).get(str(queue_id), -1)

    def journal_end(self) -> int:
        """How many ``%OFFSETS%`` records exist (the offset the next one gets)."""
        cq = self.store.queues.get((OFFSETS_TOPIC, 0))
        return 0 if cq is None else cq.max_offset

    # ------------------------------------------------------------------ changes
    def commit(self, group: str, topic: str, queue_id: int, offset: int) -> int:
        """Set an offset; journal it when it changed. Returns the commit-log position the
        change is durable at once fsynced (covers an unchanged offset's earlier record).

        Offset commits go on when the store cannot write (a full disk, writes stopped after
        a failure): the offset is then kept in memory and in the next snapshot only, as the
        journal record could not be written (0 is returned: nothing to wait for)."""
        store = self.store
        key = (group, topic, queue_id)
        if self.get(group, topic, queue_id) == offset and key not in self._pending:
            # writes stopped after a failure: its record may have been removed, and nothing
            # will be fsynced any more: in memory and the snapshot is all there is
            return 0 if store.write_failure is not None else self.last_end
        self._pending[key] = offset
        self._set(group, topic, queue_id, offset)
        return self.flush_pending()

    def commit_later(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Set an offset now and journal it with the next ``flush_pending`` (a commit
        carried by a pull: nobody waits for its durability)."""
        if self.get(group, topic, queue_id) != offset:
            self._pending[(group, topic, queue_id)] = offset
            self._set(group, topic, queue_id, offset)

    def flush_pending(self) -> int:
        """Journal the offsets set since the last call in one write; return the commit-log
        position they are durable at once fsynced (0: not journaled, see ``commit``)."""
        if not self._pending:
            return self.last_end
        store = self.store
        pending, self._pending = self._pending, {}
        if store.write_failure is not None:
            return 0
        try:
            if OFFSETS_TOPIC not in store.topics:
                store.create_topic(OFFSETS_TOPIC, 1)
            now_ms = int(store.clock() * 1000)
            parts = [commit_part(OffsetCommit(g, t, q, off), now_ms)
                     for (g, t, q), off in pending.items()]
            self.last_end = store.put(OFFSETS_TOPIC, 0, parts, dedup=False,
                                      space=False).end_position
        except OnceqError as exc:
            if not exc.retriable:
                raise
            store.errors.warning("offsets", "offsets: commits are kept in memory and "
                                 "in the snapshot only, the journal write failed: %s",
                                 exc.message)
            return 0
        return self.last_end

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
    def snapshot(self) -> tuple[bytes, int] | None:
        """(file content, records covered) if the table changed since the last one."""
        if not self.dirty:
            return None
        self.dirty = False
        covered = self.journal_end()
        return encode_snapshot(self.groups, covered), covered

    def written(self, covered: int) -> None:
        """A snapshot covering ``covered`` records is durable (may run off the loop)."""
        self.covered = max(self.covered, covered)

    def retention_floor(self) -> int | None:
        """Commit-log position of the first record no written snapshot covers (segments
        from there on must be kept), or None."""
        cq = self.store.queues.get((OFFSETS_TOPIC, 0))
        if cq is None or self.covered >= cq.max_offset:
            return None
        return cq.entry(max(self.covered, cq.min_offset))[0]

    # ------------------------------------------------------------------ open
    def load(self, raw: object) -> None:
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
        except OnceqError as exc:
            raise ValueError(f"malformed offsets snapshot: {exc.message}") from None
        self.groups, self.covered = groups, covered

    def replay(self) -> bool:
        """Apply the journal records after the snapshot; True when a snapshot must be
        written now (the log ended below what the snapshot covers)."""
        store = self.store
        cq = store.queues.get((OFFSETS_TOPIC, 0))
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
            r = store.get(OFFSETS_TOPIC, 0, offset, REPLAY_BATCH, 16 * 1024 * 1024)
            if r.status == PullStatus.FOUND:
                try:
                    for m in decode_records(r.payload):
                        self._apply(m.body, m.position, m.queue_offset)
                except RecordError as exc:  # checked on read: not expected
                    log.error("offsets: journal record unreadable: %s", exc)
            elif r.status == PullStatus.DAMAGED:
                log.error("offsets: journal records %d..%d are damaged; offsets committed "
                          "then are lost", offset, r.next_offset - 1)
            if r.next_offset <= offset:
                break
            offset = r.next_offset
        return False

    def _apply(self, body: bytes, position: int, journal_offset: int) -> None:
        try:
            c = decode_commit(body)
        except OffsetRecordError as exc:
            log.error("offsets: journal record %d: %s; skipped", journal_offset, exc)
            return
        t = self.store.topics.get(c.topic)
        if t is None or position < t.created_position or c.queue_id >= t.queues:
            return  # a deleted topic (or an older one of the same name)
        self._set(c.group, c.topic, c.queue_id, c.offset)
        self.replayed += 1

    def clamp_to_queue_ends(self) -> bool:
        """Offsets beyond their queue's end (the log was cut by recovery) move back to the
        end, so the next messages stored there are delivered, not skipped. True if any."""
        moved = False
        for group, topics in self.groups.items():
            for topic, qs in topics.items():
                for q, off in qs.items():
                    cq = self.store.queues.get((topic, int(q)))
                    if cq is not None and off > cq.max_offset:
                        log.error("offsets: group %s committed %d on %s queue %s, beyond the "
                                  "recovered queue end %d; moved back to it", group, off,
                                  topic, q, cq.max_offset)
                        qs[q] = cq.max_offset
                        moved = True
        if moved:
            self.dirty = True
        return moved


class ConsumerOffsets:
    """The consumer-offset operations of ``MessageStore`` (its ``offset_table``)."""

    offset_table: OffsetTable
    _offsets_path: str

    def _load_offsets(self) -> bool:
        """Load the offsets snapshot; False when it is damaged (logged at ERROR): the
        offsets are then rebuilt from their whole journal (``_open_offsets``)."""
        try:
            self.offset_table.load(load_json(self._offsets_path, None, self.files))
        except ValueError as exc:
            msg = str(exc)
            if self._offsets_path not in msg:
                msg = f"{self._offsets_path}: {msg}"
            log.error("offsets: %s; the offsets are rebuilt from their journal in the "
                      "commit log", msg)
            return False
        return True

    def _open_offsets(self, rewrite: bool = False) -> None:
        """Replay the offset commits after the snapshot; offsets beyond a recovered queue
        end move back to it. The snapshot is written now when either changed the past, or
        when ``rewrite`` (the snapshot was damaged)."""
        table = self.offset_table
        if table.replay() | table.clamp_to_queue_ends() | rewrite:
            table.dirty = True
            try:
                self.save_offsets()
            except OSError as exc:  # written by the periodic save or at close
                table.dirty = True
                log.error("store: cannot save the consumer offsets at start: %s", exc)

    @property
    def offsets(self) -> dict[str, dict[str, dict[str, int]]]:
        """group -> topic -> "queue" -> committed offset (see ``OffsetTable``)."""
        return self.offset_table.groups

    def commit_offset(self, group: str, topic: str, queue_id: int, offset: int) -> int:
        """Commit a group's offset; it is journaled in the commit log when it changed.

        Returns the commit-log position the commit is durable at once the log is fsynced
        up to it (a sync-flush broker answers after that)."""
        self._queue(topic, queue_id)
        check_name("group", group)
        return self.offset_table.commit(group, topic, queue_id, int(offset))

    def commit_offset_later(self, group: str, topic: str, queue_id: int, offset: int
                            ) -> None:
        """Commit a group's offset now and journal it with the next batch of such commits
        (``offset_table.flush_pending``): for commits nobody waits for."""
        self._queue(topic, queue_id)
        check_name("group", group)
        self.offset_table.commit_later(group, topic, queue_id, int(offset))

    def get_offset(self, group: str, topic: str, queue_id: int) -> int:
        """The committed offset, or -1 when the group has none for this queue."""
        self._queue(topic, queue_id)
        return self.offset_table.get(group, topic, queue_id)

    def offsets_snapshot(self) -> tuple[bytes, int] | None:
        """(``offsets.json`` content, journal records it covers) if the offsets changed
        since the last snapshot, else None. Pass both to ``write_offsets_file``.

        A caller whose write of the snapshot fails calls ``offsets_changed`` to retry later.
        """
        return self.offset_table.snapshot()

    def offsets_changed(self) -> None:
        self.offset_table.dirty = True

    def save_offsets(self) -> None:
        snap = self.offsets_snapshot()
        if snap is not None:
            self.write_offsets_file(*snap)

    def write_offsets_file(self, data: bytes, covered: int) -> None:
        """Write an offsets snapshot (safe to run off the loop)."""
        write_atomic(self._offsets_path, data, self.files)
        self.offset_table.written(covered)
