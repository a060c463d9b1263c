"""The transition-state queue lock as the broker applies it to pulls.

Wraps the pure ``AccessLockTable`` with what it needs from the broker: the group's ack
offsets (committed offsets in the store), the deliver offsets (next offset after the last
pull that found messages, never below the ack offset), and who the lock applies to:
members of CLUSTERING groups that did not switch it off, when the broker has it on.
Every handover is logged with its reason.

The holders survive a restart: every change of a holder is reported to ``on_change``, and
the broker then writes ``access_locks.json`` (temp file, fsync, rename) from
:meth:`TransitionLock.file_data`; at start :meth:`TransitionLock.load` restores them as
unconfirmed holders (see ``access_lock.py``, "Broker restarts").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from ..storage.files import OS_FILES, FileOps
from ..storage.metadata import write_atomic
from ..storage.store import MessageStore
from .access_lock import AccessLockTable, LockRow, decode_lock_rows, encode_lock_rows
from .groups import CLUSTERING, GroupRegistry

log = logging.getLogger("onceq.broker")

_Key = tuple[str, str, int]


@dataclass(slots=True)
class PullGrant:
    granted: bool
    offset: int
    holder: str


LOCK_FILE = "access_locks.json"


class TransitionLock:
    def __init__(self, store: MessageStore, groups: GroupRegistry, enabled: bool,
                 hold_timeout: float, stable_checks: int, clock: Callable[[], float],
                 restore_hold: float = 20.0, files: FileOps = OS_FILES,
                 on_change: Callable[[], None] | None = None) -> None:
        self.store = store
        self.groups = groups
        self.enabled = enabled
        self.table = AccessLockTable(hold_timeout, stable_checks, restore_hold)
        self.clock = clock
        self.files = files
        self.on_change = on_change
        self.path = os.path.join(store.config.data_dir, LOCK_FILE)
        self.deliver: dict[_Key, int] = {}
        self.handovers = 0
        self._seen_changes = 0

    # -- persistence ---------------------------------------------------------------------

    def load(self) -> int:
        """Restore the saved holders as unconfirmed (at broker start); return how many.
        A damaged file is logged and ignored: the holders then re-assert themselves."""
        try:
            rows = decode_lock_rows(self.files.read_file(self.path))
        except FileNotFoundError:
            return 0
        except ValueError as exc:
            log.error("%s: %s; starting without saved access locks", self.path, exc)
            return 0
        rows = [r for r in rows if r.topic in self.store.topics]
        self.table.restore(rows, self.clock())
        for r in rows:
            key = (r.group, r.topic, r.queue_id)
            self.deliver[key] = max(self.deliver.get(key, -1), r.deliver_offset)
        self._seen_changes = self.table.changes
        if rows:
            log.info("access lock: %d holder(s) restored, unconfirmed for %.0fs", len(rows),
                     self.table.restore_hold)
        return len(rows)

    def restored_members(self, group: str) -> list[str]:
        """Holders restored at start that have not reconnected yet (within the restore
        hold): listed as members, so that the members that reconnect first keep the
        allocation they had instead of taking the absent ones' queues for a moment."""
        return self.table.unconfirmed_holders(group, self.clock())

    def file_data(self) -> bytes:
        """The holders and their deliver offsets, as saved in ``access_locks.json``."""
        rows = [LockRow(r.group, r.topic, r.queue_id, r.holder,
                        max(r.deliver_offset,
                            self.deliver.get((r.group, r.topic, r.queue_id), -1)))
                for r in self.table.export()]
        return encode_lock_rows(rows)

    def write_file(self, data: bytes) -> None:
        write_atomic(self.path, data, self.files)

    def _changed(self) -> None:
        if self.table.changes != self._seen_changes:
            self._seen_changes = self.table.changes
            if self.on_change is not None:
                self.on_change()

    def applies(self, group: str | None, client: str | None) -> bool:
        if not self.enabled or not group or not client:
            return False
        m = self.groups.member(group, client)
        return (m is not None and m.model == CLUSTERING
                and m.meta.get("access_lock", True) is not False
                and not m.meta.get("orderly"))  # orderly members lock explicitly

    def deliver_offset(self, key: _Key, ack: int) -> int:
        return max(self.deliver.get(key, ack), ack)

    def check(self, group: str, client: str, topic: str, queue: int, requested: int
              ) -> PullGrant:
        key = (group, topic, queue)
        ack = self.store.get_offset(group, topic, queue)
        d = self.table.on_pull(group, topic, queue, client, requested, ack,
                               self.deliver_offset(key, ack), self.clock())
        if d.takeover is not None and d.previous_holder is not None:
            self.handovers += 1
            log.info("access lock %s %s:%d handed from %s to %s (%s), reading from %d",
                     group, topic, queue, d.previous_holder, client, d.takeover, d.offset)
        self._changed()
        return PullGrant(d.granted, d.offset, d.holder)

    def delivered(self, group: str, topic: str, queue: int, next_offset: int) -> None:
        key = (group, topic, queue)
        if next_offset > self.deliver.get(key, -1):
            self.deliver[key] = next_offset

    def is_holder(self, group: str, client: str, topic: str, queue: int) -> bool:
        return self.table.holder(group, topic, queue) == client

    def touch(self, *, group: str, client: str, topic: str, queue: int) -> None:
        self.table.touch(group=group, topic=topic, queue_id=queue, client_id=client,
                         now=self.clock())

    def touch_client(self, client: str) -> None:
        self.table.touch_client(client, self.clock())

    def release(self, *, group: str, client: str, topic: str, queue: int) -> bool:
        released = self.table.release(group=group, topic=topic, queue_id=queue,
                                      client_id=client)
        if released:
            log.info("access lock %s %s:%d released by %s (drained)", group, topic, queue,
                     client)
            self._changed()
        return released

    def reassert(self, group: str, client: str, held: list[tuple[str, int, int]]
                 ) -> list[tuple[str, int, bool]]:
        """The queues ``client`` says it holds in ``group`` (topic, queue, its next offset),
        sent on its heartbeats; see ``AccessLockTable.reassert``. Returns per queue whether
        the client holds it now."""
        topics = self.store.topics
        wanted = {(t, q): d for t, q, d in held if t in topics and q < topics[t].queues}
        result = self.table.reassert(group, client, wanted, self.clock())
        for (topic, queue), holds in result.items():
            key = (group, topic, queue)
            if holds and wanted[(topic, queue)] > self.deliver.get(key, -1):
                self.deliver[key] = wanted[(topic, queue)]
        self._changed()
        return [(t, q, h) for (t, q), h in sorted(result.items())]

    def member_gone(self, group: str, client: str, reason: str) -> None:
        for _g, topic, queue in self.table.release_client_group(client, group):
            log.info("access lock %s %s:%d released: holder %s %s", group, topic, queue,
                     client, reason)
        self._changed()

    def reset_queue(self, group: str, topic: str, queue: int) -> None:
        """Drop the lock and deliver offset of one queue (a forced offset reset): the next
        pull takes it from the group's new offset."""
        holder = self.table.holder(group, topic, queue)
        if holder is not None:
            self.table.release(group=group, topic=topic, queue_id=queue, client_id=holder)
            log.info("access lock %s %s:%d dropped (offsets reset); holder was %s", group,
                     topic, queue, holder)
        self.deliver.pop((group, topic, queue), None)
        self._changed()

    def drop_topic(self, topic: str) -> None:
        """Forget the locks and deliver offsets of a deleted topic (a re-created topic
        starts free)."""
        for key in [k for k in self.deliver if k[1] == topic]:
            del self.deliver[key]
        self.table.drop_topic(topic)
        self._changed()

    def status(self, group: str) -> list[dict]:
        rows = []
        for row in self.table.snapshot(group):
            key = (group, row["topic"], row["queue_id"])
            ack = self.store.get_offset(*key) if row["topic"] in self.store.topics else -1
            rows.append({
                "topic": row["topic"], "queue": row["queue_id"], "holder": row["holder"],
                "deliver": self.deliver_offset(key, ack), "ack": ack,
                "pending_handover": row["pending_handover"],
                "unconfirmed": row["unconfirmed"],
                "idle_s": round(self.clock() - row["last_access"], 3),
            })
        return rows
