"""Orderly queue locks as the broker serves them: ``LOCK_QUEUES``, ``UNLOCK_QUEUES``, the
checks on pulls and commits, and the release of a member's locks when it leaves.

The table itself is pure (``queue_lock_table.py``). Who may lock: a registered member of
the group (its locks must go when it disconnects, which the broker only knows of members).
How it coexists with the transition-state access lock (``transition.py``): one queue of a
group has one holder at a time, of one kind or the other. Orderly members (heartbeat meta
``orderly``) are outside the access lock; their lock is taken explicitly. A lock request
skips queues whose access lock another client holds (a concurrent member still consuming
or draining it), and a pull or commit by any client other than the orderly holder is
refused (LOCKED / NOT_HOLDER), so a concurrent member cannot take a queue an orderly member
holds either. See docs/consumer.md, "Orderly consumption".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..protocol.errors import ErrorCode, OnceqError
from ..storage.files import OS_FILES, FileOps
from ..storage.metadata import write_atomic
from ..storage.store import check_name
from .queue_lock_table import QueueLockTable, decode_lock_file, encode_lock_file

if TYPE_CHECKING:
    from ..storage.store import MessageStore
    from .connection import Connection
    from .durable import DurableReplies
    from .fields import Response
    from .groups import GroupRegistry
    from .offset_reset import ResetFence
    from .transition import TransitionLock

log = logging.getLogger("onceq.broker")

MAX_QUEUES = 4096  # queues in one lock or unlock request
LOCK_FILE = "queue_locks.json"


def _queues(h: dict[str, Any], with_offset: bool) -> list[tuple[str, int, int]]:
    raw = h.get("queues")
    n = 3 if with_offset else 2
    what = "[topic, queue, offset]" if with_offset else "[topic, queue]"
    if not isinstance(raw, list) or len(raw) > MAX_QUEUES or not all(
            isinstance(x, list) and len(x) == n and isinstance(x[0], str)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in x[1:])
            for x in raw):
        raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                         f"queues must be a list of at most {MAX_QUEUES} {what}")
    return [(x[0], x[1], x[2] if with_offset else -1) for x in raw]


class QueueLocks:
    def __init__(self, store: MessageStore, clock: Callable[[], float], expiry_s: float, *,
                 groups: GroupRegistry, transition: TransitionLock, fence: ResetFence,
                 durable: DurableReplies, files: FileOps = OS_FILES,
                 on_change: Callable[[], None] | None = None) -> None:
        self.store = store
        self.clock = clock
        self.groups = groups
        self.transition = transition
        self.fence = fence
        self.durable = durable
        self.table = QueueLockTable(expiry_s)
        self.files = files
        self.on_change = on_change  # the holders changed: save them (``file_data``)
        self.path = os.path.join(store.config.data_dir, LOCK_FILE)
        self._seen_changes = 0

    # ---------------------------------------------------------------- persistence
    def load(self) -> int:
        """Restore the saved locks (at broker start); return how many. A damaged file is
        logged and ignored: the holders then lock again as after any reconnect."""
        try:
            rows = decode_lock_file(self.files.read_file(self.path))
        except FileNotFoundError:
            return 0
        except ValueError as exc:
            log.error("%s: %s; starting without saved queue locks", self.path, exc)
            return 0
        rows = [r for r in rows if self._exists(r[1], r[2])]
        self.table.restore(rows, self._now())
        self._seen_changes = self.table.changes
        if rows:
            log.info("queue locks: %d restored, held for their holders for %.0fs", len(rows),
                     self.table.expiry)
        return len(rows)

    def file_data(self) -> bytes:
        return encode_lock_file(self.table.export(self._now()))

    def write_file(self, data: bytes) -> None:
        write_atomic(self.path, data, self.files)

    def changed(self) -> None:
        """After anything that may change holders: ask for a save when it did."""
        if self.table.changes != self._seen_changes:
            self._seen_changes = self.table.changes
            if self.on_change is not None:
                self.on_change()

    def restored_members(self, group: str) -> list[str]:
        """Holders of restored locks that have not locked again since the restart."""
        return self.table.restored_holders(group, self._now())

    def _now(self) -> float:
        return self.clock()

    def _member(self, h: dict[str, Any]) -> tuple[str, str]:
        group = check_name("group", h.get("group"))
        client = h.get("client")
        if not isinstance(client, str):
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "field 'client' must be a string")
        if self.groups.member(group, client) is None:
            raise OnceqError(ErrorCode.NOT_MEMBER, f"client {client!r} is not a member of "
                             f"group {group!r}: send a heartbeat before locking queues")
        return group, client

    def _exists(self, topic: str, queue: int) -> bool:
        t = self.store.topics.get(topic)
        return t is not None and 0 <= queue < t.queues

    def h_lock(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes) -> Response:
        """Lock (or renew) queues; answer those the client holds now. Queues of unknown
        topics are not granted (a deleted topic must not fail the renewal of the rest)."""
        group, client = self._member(h)
        wanted = [(t, q) for t, q, _ in _queues(h, False) if self._exists(t, q)]
        access = self.transition.table

        def taken(topic: str, queue: int) -> str | None:
            return access.holder(group, topic, queue)

        held = self.table.lock(group, client, wanted, self._now(), taken)
        self.changed()
        return 0, {"locked": [[t, q] for t, q in sorted(held)]}, b""

    def h_unlock(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes) -> Response:
        """Commit each queue's offset (>= 0), then release its lock: holder only."""
        group = check_name("group", h.get("group"))
        client = h.get("client")
        if not isinstance(client, str):
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "field 'client' must be a string")
        items = _queues(h, True)
        store, fence = self.store, self.fence
        fence.seen(group, client, h.get("reset_gen"))
        offsets = {(t, q): off for t, q, off in items}
        end = 0

        def commit(queue: tuple[str, int]) -> None:
            nonlocal end
            off = offsets[queue]
            if off >= 0 and queue[0] in store.topics and not fence.blocks(group, client,
                                                                            *queue):
                end = max(end, store.commit_offset(group, *queue, off))

        released = self.table.unlock(group, client, list(offsets), self._now(), commit)
        self.changed()
        return self.durable.reply(conn, corr,
                                  {"unlocked": [[t, q] for t, q in sorted(released)]}, end=end)

    # ---------------------------------------------------------------- hooks
    def refuses(self, group: str, client: str | None, topic: str, queue: int) -> bool:
        """Whether another client holds the queue's orderly lock (pulls and commits of
        ``client`` are refused then)."""
        holder = self.table.holder(group, topic, queue, self._now())
        return holder is not None and holder != client

    def member_gone(self, group: str, client: str, reason: str) -> None:
        for _g, topic, queue in self.table.release_client(client, group):
            log.info("queue lock %s %s:%d released: holder %s %s", group, topic, queue,
                     client, reason)
        self.changed()

    def status(self, group: str) -> list[dict[str, Any]]:
        return self.table.snapshot(group, self._now())
