"""The leader's side of log replication (Kafka's design): followers fetch the commit log
from their own log end (``REPLICA_FETCH``); the leader tracks what each has
(``isr.py``), the in-sync replicas and the high watermark, answers writes once the
replicas have them (``acks=all``), and shows consumers only what is below the high
watermark.

A fetch with nothing to send is held up to its ``wait_ms`` and answered as soon as the
log grows. A write waits (``replicated``) until the high watermark passes its end while
at least ``min_insync`` replicas are in sync, else it is answered ``NOT_ENOUGH_REPLICAS``
(retriable: the producer's unique key makes the retry safe).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..cluster import EtcdError
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import EpochEnd, ReplicaData
from ..storage.leader_epochs import LeaderEpochs, assign, epoch_end
from ..storage.records import first_offset_past
from ..storage.replica import ReplicaLog, topics_signature
from .isr import ReplicaTracker

if TYPE_CHECKING:
    from ..cluster import Leadership
    from ..protocol.requests import ReplicaEpochEnd, ReplicaFetch
    from ..storage.store import MessageStore
    from .config import BrokerConfig
    from .fields import Call
    from .group_role import GroupRole

log = logging.getLogger("onceq.broker")


@dataclass(slots=True, eq=False)
class _HeldFetch:
    call: Call
    req: ReplicaFetch
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True, eq=False)
class _AckWait:
    end: int
    deadline: float
    future: asyncio.Future[None]


class LeaderReplication:
    """``on_hw(hw)`` is told when the high watermark moves (held pulls may wake)."""

    def __init__(self, config: BrokerConfig, store: MessageStore, role: GroupRole,
                 replica_log: ReplicaLog, epochs: LeaderEpochs,
                 on_hw: Callable[[int], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.store = store
        self.role = role
        self.replica_log = replica_log
        self.epochs = epochs
        self.on_hw = on_hw
        self.clock = clock
        self.tracker: ReplicaTracker | None = None  # set while leading
        self.epoch = 0
        self.term: Leadership | None = None
        self._publishing = False  # an ISR write to etcd is in flight
        self._held: list[_HeldFetch] = []
        self._acks: list[_AckWait] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.isr_changes = 0  # ISRs published in etcd

    # ---------------------------------------------------------------- terms
    def begin(self, term: Leadership, hw: int, published: tuple[str, ...],
              live: set[str]) -> None:
        """This broker leads from now on, in ``term``; ``hw``: the high watermark it
        knew as a follower; ``published``: the ISR in etcd; ``live``: the registered
        brokers."""
        end = self.store.log.end
        self.epochs.set(assign(self.epochs.entries, term.epoch, end))
        self.epoch = term.epoch
        self.term = term
        self.tracker = ReplicaTracker(self.role.broker_id, self.config.replica_lag_max_ms,
                                      min(hw, end))
        self.tracker.seed(published, live, self._now_ms())
        self._advance()

    def end(self) -> None:
        """The term is over: pending writes and held fetches are answered NOT_LEADER."""
        self.tracker = None
        err = self.role.not_leader()
        acks, self._acks = self._acks, []
        for a in acks:
            if not a.future.done():
                a.future.set_exception(err)
        held, self._held = self._held, []
        for h in held:
            if h.timer is not None:
                h.timer.cancel()
            h.call.fail(err)

    # ---------------------------------------------------------------- the ISR and HW
    def _now_ms(self) -> float:
        return self.clock() * 1000

    def in_sync(self) -> list[str]:
        t = self.tracker
        return [] if t is None else t.in_sync(self._now_ms())

    @property
    def hw(self) -> int:
        t = self.tracker
        return 0 if t is None else t.hw

    def _advance(self) -> None:
        t = self.tracker
        if t is None:
            return
        before = t.hw
        cfg = self.config
        now_ms = self._now_ms()
        hw = t.advance(self.store.log.end, now_ms, cfg.min_insync if cfg.acks == "all" else 1)
        want = t.to_publish(now_ms)
        if want is not None and not self._publishing:
            self._publish(t, want)
        self._settle()
        if hw != before:
            self.on_hw(hw)

    def _publish(self, t: ReplicaTracker, members: list[str]) -> None:
        """Write the ISR to etcd; the high watermark counts the replicas etcd may elect
        until then (``isr.py``), so a shrink is published before what it allows is
        acknowledged."""
        term = self.term
        if term is None:
            return
        self._publishing = True

        async def write() -> None:
            try:
                if await self.role.publish_isr(term, members):
                    if self.tracker is t:
                        log.warning("group %s: in-sync replicas of epoch %d: %s",
                                    self.role.group, term.epoch, ", ".join(members))
                        t.published = tuple(members)
                        self.isr_changes += 1
                else:
                    log.warning("group %s: the ISR of epoch %d was not published: the "
                                "term is over", self.role.group, term.epoch)
            except (EtcdError, OSError) as exc:
                log.warning("group %s: cannot publish the ISR: %s; retrying",
                            self.role.group, exc)
            finally:
                self._publishing = False
            if self.tracker is t:
                self._advance()

        task = asyncio.get_running_loop().create_task(write())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _settle(self) -> None:
        """Answer the writes below the high watermark, and those past their timeout."""
        if not self._acks:
            return
        t = self.tracker
        assert t is not None
        now = self.clock()
        enough = len(t.in_sync(now * 1000)) >= self.config.min_insync
        keep = []
        for a in self._acks:
            if a.future.done():
                continue
            if not enough:  # answered now: waiting would not help
                a.future.set_exception(self._too_few("after the write"))
            elif a.end <= t.hw:
                a.future.set_result(None)
            elif now >= a.deadline:
                a.future.set_exception(OnceqError(
                    ErrorCode.NOT_ENOUGH_REPLICAS,
                    f"the write was not replicated to the in-sync replicas within "
                    f"{self.config.replica_ack_timeout_ms} ms (in sync: "
                    f"{', '.join(t.in_sync(now * 1000))}); try again"))
            else:
                keep.append(a)
        self._acks = keep

    def _too_few(self, when: str) -> OnceqError:
        isr = self.in_sync()
        return OnceqError(ErrorCode.NOT_ENOUGH_REPLICAS,
                          f"{len(isr)} in-sync replica(s) ({', '.join(isr)}) {when}, fewer "
                          f"than min_insync {self.config.min_insync}: try again")

    def tick(self) -> None:
        """Periodic: followers that stopped fetching leave the ISR; writes time out."""
        self._advance()

    # ---------------------------------------------------------------- writes and reads
    def check_write(self) -> None:
        """Before a client write (acks=all): refuse it while too few replicas are in sync."""
        if self.config.acks == "all" and len(self.in_sync()) < self.config.min_insync:
            raise self._too_few("now")

    def replicated(self, end: int) -> asyncio.Future[None] | None:
        """A write that ends at ``end`` was made: None when it may be answered now, else
        a future done when it may (or failed)."""
        self.log_grew()
        t = self.tracker
        if self.config.acks == "leader":
            return None
        if t is None:
            raise self.role.not_leader()
        if end <= t.hw and len(t.in_sync(self._now_ms())) >= self.config.min_insync:
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._acks.append(_AckWait(end, self.clock() + self.config.replica_ack_timeout_ms
                                   / 1000, fut))
        return fut

    def log_grew(self) -> None:
        """The log grew: answer the held fetches, move the high watermark (a leader alone
        in its ISR has its own end as high watermark)."""
        held, self._held = self._held, []
        for h in held:
            if h.timer is not None:
                h.timer.cancel()
            self._answer(h.call, h.req)
        self._advance()

    def visible_end(self, topic: str, queue: int) -> int | None:
        """The first offset of the queue consumers may not see yet (its record ends past
        the high watermark), or None when they may see everything."""
        t = self.tracker
        if t is None:
            return None
        hw = t.hw
        if hw >= self.store.log.end:
            return None
        cq = self.store.queues.get((topic, queue))
        if cq is None or cq.max_offset == cq.min_offset:
            return None
        pos, size, _th, _ts = cq.entry(cq.max_offset - 1)
        if pos + size <= hw:
            return None
        return first_offset_past(cq, hw)

    # ---------------------------------------------------------------- the requests
    def h_fetch(self, call: Call, req: ReplicaFetch) -> None:
        """``REPLICA_FETCH``: answered by ``_fetch`` (now, or once the log grows)."""
        task = asyncio.get_running_loop().create_task(self._fetch(call, req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fetch(self, call: Call, req: ReplicaFetch) -> None:
        try:
            if req.group != self.role.group:
                raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                                 f"this broker is of group {self.role.group}, not {req.group}")
            if not await self.role.is_member(req.broker):
                raise OnceqError(ErrorCode.ACCESS_DENIED, f"broker {req.broker} is not a "
                                 f"registered member of group {self.role.group}")
            t = self.tracker
            if t is None or not self.role.is_leader():
                raise self.role.not_leader()
            if req.epoch != self.epoch:
                raise OnceqError(ErrorCode.STALE_EPOCH,
                                 f"fetch under epoch {req.epoch}; the leader's is {self.epoch}",
                                 {"epoch": self.epoch})
            end = self.store.log.end
            if not 0 <= req.position <= end:
                raise OnceqError(ErrorCode.STALE_EPOCH,
                                 f"fetch from {req.position}, past the leader's log end {end}: "
                                 "cut the divergent tail first", {"epoch": self.epoch})
            t.fetched(req.broker, req.position, end, self._now_ms())
            self._advance()
            if req.position == end and req.wait_ms > 0:
                held = _HeldFetch(call, req)
                held.timer = asyncio.get_running_loop().call_later(
                    req.wait_ms / 1000, self._expire, held)
                self._held.append(held)
                return
            self._answer(call, req)
        except OnceqError as exc:
            call.fail(exc)

    def _expire(self, held: _HeldFetch) -> None:
        if held in self._held:
            self._held.remove(held)
            self._answer(held.call, held.req)

    def _answer(self, call: Call, req: ReplicaFetch) -> None:
        if self.tracker is None:
            call.fail(self.role.not_leader())
            return
        try:
            data = self.replica_log.read(req.position, min(req.max_bytes,
                                                          self.config.replica_fetch_bytes))
        except (OSError, KeyError) as exc:
            call.fail(OnceqError(ErrorCode.STORAGE_ERROR, f"cannot read the log at "
                                 f"{req.position}: {exc}"))
            return
        table = self.replica_log.topics_table()
        sig = topics_signature(table)
        call.answer(ReplicaData(self.epoch, req.position, self.hw, self.store.log.end,
                                [list(e) for e in self.epochs.entries], sig,
                                None if sig == req.topics else table, data))

    def h_epoch_end(self, call: Call, req: ReplicaEpochEnd) -> EpochEnd:
        if self.tracker is None or not self.role.is_leader():
            raise self.role.not_leader()
        return EpochEnd(*epoch_end(self.epochs.entries, req.epoch, self.store.log.end))
