"""Whose commits set a group's ack offset on a queue.

A queue of a group has one holder at a time, under the transition-state access lock
(``transition.py``) or the orderly queue lock (``queue_lock.py``). Only the holder's
commits count: a client that lost the queue (or never had it) must not move the offset
back under the one consuming it now. Pulls with a piggy-backed commit, explicit commits and
the release at the end of a drain all ask this rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .queue_lock import QueueLocks
    from .transition import TransitionLock


class CommitRule:
    def __init__(self, transition: TransitionLock, queue_locks: QueueLocks) -> None:
        self.transition = transition
        self.queue_locks = queue_locks

    def may_commit(self, *, group: str, client: str | None, topic: str, queue: int) -> bool:
        """Whether a commit from ``client`` (None: it sent no id) may set the group's offset.

        A member the access lock applies to must hold the queue; any other committer (a
        pull consumer, a group without the lock) only while no other client holds it."""
        if self.queue_locks.refuses(group, client, topic, queue):
            return False  # another client holds the queue's orderly lock
        holder = self.transition.table.holder(group, topic, queue)
        if client is not None and self.transition.applies(group, client):
            return holder == client
        return holder is None or holder == client
