"""The queue-ownership core (``ownership.py``) as the broker serves it.

Facts go in from the store (a queue's committed offset and end) and the member registry
(whether the access lock applies to a client: a member of a CLUSTERING group that did not
switch it off, not an orderly member, while the broker has the lock on); decisions come
back and are applied here (offsets stored, handovers logged). The pull service and the
consumer group service call it; it answers the orderly ``LOCK_QUEUES`` and
``UNLOCK_QUEUES`` itself.

The state survives a restart: whenever it changed, the broker writes ``ownership.json``
(:meth:`OwnershipService.file_data`, temp file, fsync, rename) and :meth:`load` restores it
at start. A broker that still has the files of earlier versions (``access_locks.json``,
``queue_locks.json``, ``reset_fences.json``) reads those once instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import Locked, Unlocked
from ..storage.files import OS_FILES, FileOps
from ..storage.metadata import write_atomic
from ..storage.store import check_name
from .access_lock import decode_lock_rows
from .groups import CLUSTERING, GroupRegistry
from .ownership import CommitDecision, PullDecision, QueueOwnership
from .queue_lock_table import decode_lock_file

if TYPE_CHECKING:
    from ..protocol.requests import LockQueues, UnlockQueues
    from ..storage.store import MessageStore
    from .config import BrokerConfig
    from .durable import DurableReplies
    from .fields import Call

log = logging.getLogger("onceq.broker")

FILE = "ownership.json"
LEGACY_FILES = ("access_locks.json", "queue_locks.json", "reset_fences.json")


class OwnershipService:
    def __init__(self, config: BrokerConfig, store: MessageStore, groups: GroupRegistry,
                 clock: Callable[[], float], *, durable: DurableReplies,
                 files: FileOps = OS_FILES, on_change: Callable[[], None] | None = None
                 ) -> None:
        self.core = QueueOwnership(
            hold_timeout=config.access_lock_hold_s, stable_checks=config.access_lock_stable_checks,
            restore_hold=config.access_lock_restore_hold_s, lock_expiry=config.queue_lock_expiry_s)
        self.enabled = config.access_lock
        self.store = store
        self.groups = groups
        self.clock = clock
        self.durable = durable
        self.files = files
        self.on_change = on_change  # the state changed: save it (``file_data``)
        self.path = os.path.join(store.config.data_dir, FILE)
        self.handovers = 0  # queues the access lock handed from one member to another
        self._seen_changes = 0

    # ---------------------------------------------------------------- facts
    def applies(self, group: str | None, client: str | None) -> bool:
        """Whether the access lock applies to ``client`` in ``group``."""
        if not self.enabled or not group or not client:
            return False
        m = self.groups.member(group, client)
        return (m is not None and m.model == CLUSTERING
                and m.meta.get("access_lock", True) is not False
                and not m.meta.get("orderly"))  # orderly members lock explicitly

    def _exists(self, topic: str, queue: int) -> bool:
        t = self.store.topics.get(topic)
        return t is not None and 0 <= queue < t.queues

    def changed(self) -> None:
        if self.core.changes != self._seen_changes:
            self._seen_changes = self.core.changes
            if self.on_change is not None:
                self.on_change()

    # ---------------------------------------------------------------- pulls
    def pull(self, group: str, client: str | None, topic: str, queue: int, offset: int
             ) -> PullDecision:
        locked = self.applies(group, client)
        ack = self.store.get_offset(group, topic, queue) if locked else -1
        d = self.core.pull(group, client, topic, queue, offset, locked=locked, ack=ack,
                           now=self.clock())
        lock = d.lock
        if lock is not None and lock.takeover is not None and lock.previous_holder is not None:
            self.handovers += 1
            log.info("access lock %s %s:%d handed from %s to %s (%s), reading from %d",
                     group, topic, queue, lock.previous_holder, client, lock.takeover,
                     d.offset)
        self.changed()
        return d

    def delivered(self, group: str, topic: str, queue: int, next_offset: int) -> None:
        self.core.delivered(group, topic, queue, next_offset)

    def holder(self, group: str, topic: str, queue: int) -> str | None:
        """The access lock's holder of the queue."""
        return self.core.access.holder(group, topic, queue)

    def touch(self, group: str, client: str, topic: str, queue: int) -> None:
        self.core.touch(group, client, topic, queue, self.clock())

    # ---------------------------------------------------------------- commits
    def commit(self, group: str, client: str | None, topic: str, queue: int, offset: int, *,
               later: bool = False, checked: bool = False, locked: bool | None = None
               ) -> tuple[CommitDecision, int]:
        """Apply the commit rule and store what it allows (``later``: journaled with the next
        batch of commits, for commits nobody waits for; ``locked``: whether the access lock
        applies to the client, when the caller knows). Returns the decision and the
        commit-log position the commit is durable at (0: nothing written)."""
        d = self.core.commit(group, client, topic, queue, offset,
                             locked=self.applies(group, client) if locked is None else locked,
                             stored=self.store.get_offset(group, topic, queue),
                             queue_max=self.store.min_max(topic, queue)[1],
                             now=self.clock(), checked=checked)
        return d, self._write(group, topic, queue, d, later)

    def _write(self, group: str, topic: str, queue: int, d: CommitDecision | None,
               later: bool = False) -> int:
        if d is None or d.write is None:
            return 0
        if later:
            self.store.offsets.commit_later(group, topic, queue, d.write)
            return 0
        return self.store.commit_offset(group, topic, queue, d.write)

    def release(self, group: str, client: str, topic: str, queue: int, offset: int | None
                ) -> tuple[bool, int]:
        """End of a drain: the final commit, then the access lock goes. Returns (released,
        durable position)."""
        released, d = self.core.release(
            group, client, topic, queue, offset, locked=self.applies(group, client),
            stored=self.store.get_offset(group, topic, queue),
            queue_max=self.store.min_max(topic, queue)[1], now=self.clock())
        end = self._write(group, topic, queue, d)
        if released:
            log.info("access lock %s %s:%d released by %s (drained)", group, topic, queue,
                     client)
            self.changed()
        return released, end

    # ---------------------------------------------------------------- membership
    def heartbeat(self, group: str, client: str, held: list[tuple[str, int, int]] | None,
                  gen: object) -> tuple[bool, list[tuple[str, int, bool]], dict | None]:
        """A member's heartbeat in ``group`` (after its registration). Returns whether the
        access lock applies to it, per listed queue whether it holds it, and the reset
        notice it still has to handle."""
        locked = self.applies(group, client)
        if held is not None:
            held = [x for x in held if self._exists(x[0], x[1])]
        holds, pending = self.core.heartbeat(group, client, held, gen, locked=locked,
                                             now=self.clock())
        self.changed()
        return locked, holds, pending

    def touch_client(self, client: str) -> None:
        self.core.touch_client(client, self.clock())

    def seen(self, group: str, client: str | None, gen: object) -> None:
        """The member reports it has handled resets up to ``gen``."""
        self.core.fences.seen(group, client, gen)
        self.changed()

    def member_gone(self, group: str, client: str, reason: str) -> None:
        access, orderly = self.core.member_gone(group, client)
        for _g, topic, queue in access:
            log.info("access lock %s %s:%d released: holder %s %s", group, topic, queue,
                     client, reason)
        for _g, topic, queue in orderly:
            log.info("queue lock %s %s:%d released: holder %s %s", group, topic, queue,
                     client, reason)
        self.changed()

    def unregistered(self, group: str, client: str) -> None:
        self.core.unregistered(group, client)
        self.changed()

    def reset(self, group: str, members: list[str], queues: set[tuple[str, int]]) -> int:
        """A forced reset: fence ``members`` on ``queues``, drop the queues' access locks."""
        gen = self.core.reset(group, members, queues, self.clock())
        for topic, queue in sorted(queues):
            log.info("access lock %s %s:%d dropped (offsets reset)", group, topic, queue)
        self.changed()
        return gen

    def drop_topic(self, topic: str) -> None:
        self.core.drop_topic(topic)
        self.changed()

    def expire(self) -> None:
        self.core.expire(self.clock(), lambda g, c: self.groups.member(g, c) is not None)
        self.changed()

    def restored_members(self, group: str) -> list[str]:
        """Holders of locks restored at start that have not come back yet (within their
        hold): listed as members, so that the members that reconnect first keep the
        allocation they had instead of taking the absent ones' queues for a moment."""
        return self.core.restored_members(group, self.clock())

    # ---------------------------------------------------------------- orderly locks
    def _member(self, req: LockQueues) -> tuple[str, str]:
        group, client = check_name("group", req.group), req.client
        if self.groups.member(group, client) is None:
            raise OnceqError(ErrorCode.NOT_MEMBER, f"client {client!r} is not a member of "
                             f"group {group!r}: send a heartbeat before locking queues")
        return group, client

    def h_lock(self, call: Call, req: LockQueues) -> Locked:
        """Lock (or renew) queues; answer those the client holds now. Queues of unknown
        topics are not granted (a deleted topic must not fail the renewal of the rest)."""
        group, client = self._member(req)
        wanted = [(r.topic, r.queue) for r in req.queues if self._exists(r.topic, r.queue)]
        held = self.core.lock(group, client, wanted, self.clock())
        self.changed()
        return Locked([[t, q] for t, q in sorted(held)])

    def h_unlock(self, call: Call, req: UnlockQueues) -> Unlocked | None:
        """Commit each queue's offset (when given) under the commit rule, then release its
        lock: holder only."""
        group, client = check_name("group", req.group), req.client
        self.seen(group, client, req.reset_gen)
        offsets = {(r.topic, r.queue): r.offset for r in req.queues}
        end = 0

        def commit(queue: tuple[str, int]) -> None:  # the holder's, before the unlock
            nonlocal end
            off = offsets[queue]
            if off is not None and queue[0] in self.store.topics:
                end = max(end, self.commit(group, client, *queue, off)[1])

        released = self.core.unlock(group, client, list(offsets), self.clock(), commit)
        self.changed()
        return self.durable.reply(call, Unlocked([[t, q] for t, q in sorted(released)]),
                                  end=end)

    # ---------------------------------------------------------------- views
    def status(self, group: str) -> list[dict]:
        """The access locks of ``group``: holder, deliver and ack offsets, handover state."""
        rows = []
        now = self.clock()
        for row in self.core.access.snapshot(group):
            key = (group, row["topic"], row["queue_id"])
            ack = self.store.get_offset(*key) if row["topic"] in self.store.topics else -1
            rows.append({
                "topic": row["topic"], "queue": row["queue_id"], "holder": row["holder"],
                "deliver": self.core.deliver_offset(key, ack), "ack": ack,
                "pending_handover": row["pending_handover"],
                "unconfirmed": row["unconfirmed"],
                "idle_s": round(now - row["last_access"], 3),
            })
        return rows

    def orderly_status(self, group: str) -> list[dict[str, Any]]:
        return self.core.orderly.snapshot(group, self.clock())

    # ---------------------------------------------------------------- persistence
    def load(self) -> int:
        """Restore the saved state at start (and start the restart protocol); return how
        many access locks were restored. A damaged file is logged and ignored: holders
        then re-assert themselves, orderly members lock again."""
        data = self._read(self.path)
        now = self.clock()
        try:
            if data is None and any(self._read(self._legacy(n)) is not None
                                    for n in LEGACY_FILES):
                counts = self._load_legacy(now)
            else:
                counts = self.core.restore(data, now, self._exists)
        except ValueError as exc:
            log.error("%s: %s; starting without saved locks and fences", self.path, exc)
            counts = (0, 0, 0)
        self._seen_changes = self.core.changes
        access, orderly, fenced = counts
        if access:
            log.info("access lock: %d holder(s) restored, unconfirmed for %.0fs", access,
                     self.core.access.restore_hold)
        if orderly:
            log.info("queue locks: %d restored, held for their holders for %.0fs", orderly,
                     self.core.orderly.expiry)
        if fenced:
            log.info("offset resets: %d member(s) still fenced", fenced)
        return access

    def _legacy(self, name: str) -> str:
        return os.path.join(self.store.config.data_dir, name)

    def _read(self, path: str) -> bytes | None:
        try:
            return self.files.read_file(path)
        except FileNotFoundError:
            return None

    def _load_legacy(self, now: float) -> tuple[int, int, int]:
        """The state as the files of earlier versions held it, each read on its own (a
        damaged one is logged and left out)."""
        def read(name: str, decode: Callable[[bytes], Any]) -> Any:
            data = self._read(self._legacy(name))
            try:
                return None if data is None else decode(data)
            except ValueError as exc:
                log.error("%s: %s; ignored", self._legacy(name), exc)
                return None

        core = self.core
        core.restore(None, now, self._exists)  # starts the restart protocol
        access = [r for r in read(LEGACY_FILES[0], decode_lock_rows) or []
                  if self._exists(r.topic, r.queue_id)]
        orderly = [r for r in read(LEGACY_FILES[1], decode_lock_file) or []
                   if self._exists(r[1], r[2])]
        read(LEGACY_FILES[2], core.fences.restore)
        core.access.restore(access, now)
        core.orderly.restore(orderly, now)
        core.deliver = {(r.group, r.topic, r.queue_id): r.deliver_offset for r in access}
        return len(access), len(orderly), len(core.fences)

    def file_data(self) -> bytes:
        return self.core.encode(self.clock())

    def write_file(self, data: bytes) -> None:
        write_atomic(self.path, data, self.files)
        for name in LEGACY_FILES:  # superseded once the state is written in one file
            with contextlib.suppress(FileNotFoundError):
                self.files.unlink(self._legacy(name))
