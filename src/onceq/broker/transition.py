"""The transition-state queue lock as the broker applies it to pulls.

Wraps the pure ``AccessLockTable`` with what it needs from the broker: the group's ack
offsets (committed offsets in the store), the deliver offsets (next offset after the last
pull that found messages, never below the ack offset), and who the lock applies to:
members of CLUSTERING groups that did not switch it off, when the broker has it on.
Every handover is logged with its reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..storage.store import MessageStore
from .access_lock import AccessLockTable
from .groups import CLUSTERING, GroupRegistry

log = logging.getLogger("onceq.broker")

_Key = tuple[str, str, int]


@dataclass(slots=True)
class PullGrant:
    granted: bool
    offset: int
    holder: str


class TransitionLock:
    def __init__(self, store: MessageStore, groups: GroupRegistry, enabled: bool,
                 hold_timeout: float, stable_checks: int, clock: Callable[[], float]) -> None:
        self.store = store
        self.groups = groups
        self.enabled = enabled
        self.table = AccessLockTable(hold_timeout, stable_checks)
        self.clock = clock
        self.deliver: dict[_Key, int] = {}
        self.handovers = 0

    def applies(self, group: str | None, client: str | None) -> bool:
        if not self.enabled or not group or not client:
            return False
        m = self.groups.member(group, client)
        return (m is not None and m.model == CLUSTERING
                and m.meta.get("access_lock", True) is not False)

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
        return PullGrant(d.granted, d.offset, d.holder)

    def delivered(self, group: str, topic: str, queue: int, next_offset: int) -> None:
        key = (group, topic, queue)
        if next_offset > self.deliver.get(key, -1):
            self.deliver[key] = next_offset

    def is_holder(self, group: str, client: str, topic: str, queue: int) -> bool:
        return self.table.holder(group, topic, queue) == client

    def touch(self, group: str, client: str, topic: str, queue: int) -> None:
        self.table.touch(group, topic, queue, client, self.clock())

    def touch_client(self, client: str) -> None:
        self.table.touch_client(client, self.clock())

    def release(self, group: str, client: str, topic: str, queue: int) -> bool:
        released = self.table.release(group, topic, queue, client)
        if released:
            log.info("access lock %s %s:%d released by %s (drained)", group, topic, queue,
                     client)
        return released

    def member_gone(self, group: str, client: str, reason: str) -> None:
        for _g, topic, queue in self.table.release_client_group(client, group):
            log.info("access lock %s %s:%d released: holder %s %s", group, topic, queue,
                     client, reason)

    def drop_topic(self, topic: str) -> None:
        """Forget the locks and deliver offsets of a deleted topic (a re-created topic
        starts free)."""
        for key in [k for k in self.deliver if k[1] == topic]:
            del self.deliver[key]
        self.table.drop_topic(topic)

    def status(self, group: str) -> list[dict]:
        rows = []
        for row in self.table.snapshot(group):
            key = (group, row["topic"], row["queue_id"])
            ack = self.store.get_offset(*key) if row["topic"] in self.store.topics else -1
            rows.append({
                "topic": row["topic"], "queue": row["queue_id"], "holder": row["holder"],
                "deliver": self.deliver_offset(key, ack), "ack": ack,
                "pending_handover": row["pending_handover"],
                "idle_s": round(self.clock() - row["last_access"], 3),
            })
        return rows
