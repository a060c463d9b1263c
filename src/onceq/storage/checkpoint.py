"""Checkpoints: the commit-log position below which the next open trusts the indexes, and
the dedup window's journal chunk written with each.

A checkpoint fsyncs the log and the index files written since the last one, then records
the log end (and each queue's entry count) atomically; the dedup window's new entries up to
that end are then appended to its journal (``dedup_journal``). At open, the journal
restores the window, and only the log after its end is read again.

The queues' entry counts are taken on the loop together with the index files to fsync
(``dirty_index_files``), never off the loop while sends go on: every entry counted is then
in a file that this checkpoint (or an earlier one) fsyncs, so after a power cut no index
holds fewer entries than the checkpoint says, and the restart reads only the log after it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .dedup_journal import DedupJournal, PendingChunk
from .metadata import encode_checkpoint, write_atomic
from .openfiles import fsync_paths

if TYPE_CHECKING:
    from collections.abc import Callable

    from .commitlog import CommitLog
    from .damage import DamageRegistry
    from .dedup import DedupWindow
    from .files import FileOps
    from .topics import Topics

log = logging.getLogger("onceq.storage")


@dataclass(frozen=True, slots=True)
class DirtyIndexes:
    """What a checkpoint needs of the indexes, taken on the loop in one step: the index
    files written since the last take (to fsync) and each queue's next offset then
    (``"topic/queue" -> offset``), every entry of which those files or earlier checkpoints
    hold."""

    paths: list[str]
    ends: dict[str, int]


class Checkpoints:
    """The checkpoints (the file at ``path``) of the log and the consume queues of
    ``topics``, and the journal of the dedup window ``dedup``."""

    def __init__(self, path: str, log_: CommitLog, topics: Topics, dedup: DedupWindow,
                 journal: DedupJournal, damage: DamageRegistry, files: FileOps,
                 clock: Callable[[], float], legacy_dedup_path: str) -> None:
        self.path = path
        self.log = log_
        self.topics = topics
        self.dedup = dedup
        self.journal = journal
        self.damage = damage
        self.files = files
        self.clock = clock
        self.legacy_dedup_path = legacy_dedup_path  # the window's file before the journal

    def write(self) -> None:
        """Fsync log and indexes, then record that everything before the log end is indexed."""
        end = self.log.end
        chunk = self.dedup_chunk(end)
        self.log.sync()
        self.checkpoint_at(end, self.dirty_index_files(), chunk)

    def dirty_index_files(self) -> DirtyIndexes:
        """The index files written since the last call (to fsync before a checkpoint) and
        the queues' ends they cover; take it on the loop, after the log end ``end`` that
        the checkpoint records, and pass it to ``checkpoint_at``."""
        queues = self.topics.queues
        paths = [p for cq in queues.values() for p in cq.dirty_paths()]
        ends = {f"{t}/{q}": cq.max_offset for (t, q), cq in queues.items()}
        return DirtyIndexes(paths, ends)

    def checkpoint_at(self, end: int, indexes: DirtyIndexes,
                      dedup_chunk: PendingChunk | None = None) -> None:
        """Fsync the index files of ``indexes`` and record ``end`` as indexed with the
        queue ends of ``indexes``, then append ``dedup_chunk`` to the dedup window's
        journal (safe to run off the loop: nothing here reads what the loop changes)."""
        fsync_paths(self.files, indexes.paths)
        write_atomic(self.path, encode_checkpoint(end, indexes.ends), self.files)
        if dedup_chunk is not None:
            d = self.dedup
            self.journal.append(dedup_chunk, d.window_ms, d.max_keys, int(self.clock() * 1000))

    def restore_dedup(self, checkpoint: int | None) -> int | None:
        """Fill the dedup window from its journal, when no damage is known; the log
        position below which it then holds every key (the recovery reads the log after
        it), or None."""
        try:
            self.files.unlink(self.legacy_dedup_path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.error("store: cannot remove %s: %s", self.legacy_dedup_path, exc)
        if (checkpoint is None or not self.dedup.enabled or self.damage.log_ranges
                or self.log.end < checkpoint):
            return None
        restored_to = self.journal.load(self.dedup, checkpoint, self.log.end,
                                        self.topics.positions())
        if restored_to is not None:
            log.info("store: dedup window of %d keys restored from its journal (log read "
                     "from position %d)", len(self.dedup), restored_to)
        return restored_to

    def dedup_chunk(self, end: int) -> PendingChunk | None:
        """The dedup window's entries for its journal, up to log position ``end`` (take it
        on the loop with ``end``; ``checkpoint_at`` writes it)."""
        return self.journal.take(self.dedup, end, self.topics.positions())
