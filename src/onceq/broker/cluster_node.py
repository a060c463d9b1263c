"""A broker in a broker group (``--cluster``): its role (``group_role.py``), and the
replication that goes with it, the leader's (``replication.py``) or the follower's
(``follower.py``). The broker asks it, per request, whether to serve (``admit``), and
hands it every write's end (``replicated``) and every pull's queue (``visible_end``).

Only the leader serves clients. A follower answers every client request but a few
(``FOLLOWER_SERVES``) with ``NOT_LEADER``, naming the leader; a leader whose lease can no
longer be counted on is a follower at once (``is_leader`` checks the clock on each call).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..cluster import EtcdError
from ..protocol.codes import RequestCode as R
from ..protocol.errors import ErrorCode, OnceqError
from ..storage.leader_epochs import LeaderEpochs
from ..storage.replica import ReplicaLog
from .follower import Follower
from .group_role import GroupRole
from .replication import LeaderReplication

if TYPE_CHECKING:
    from ..cluster import LeaderRecord, Leadership
    from ..storage.store import MessageStore
    from .config import BrokerConfig
    from .fields import Call
    from .flush import Flusher

log = logging.getLogger("onceq.broker")

# what a follower answers itself; everything else is the leader's
FOLLOWER_SERVES = frozenset({R.PING, R.AUTHENTICATE, R.BROKER_STATUS, R.LIST_TOPICS,
                             R.REPLICA_FETCH, R.REPLICA_EPOCH_END, R.GET_ROUTE})
# client writes: refused before they are made while too few replicas are in sync
CLIENT_WRITES = frozenset({R.SEND, R.SEND_BATCH, R.SEND_RECORDS, R.SEND_SEQUENCED,
                           R.CONSUMER_SEND_BACK, R.COPY_QUEUE})


class ClusterNode:
    def __init__(self, config: BrokerConfig, store: MessageStore, *,
                 flusher: Callable[[], Flusher | None], on_hw: Callable[[int], None],
                 on_append: Callable[[], None], on_promoted: Callable[[], None]) -> None:
        self.config = config
        self.store = store
        self.on_promoted = on_promoted
        self.epochs = LeaderEpochs(config.store.data_dir)
        self.replica_log = ReplicaLog(store)
        self.role: GroupRole | None = None
        self.leading: LeaderReplication | None = None
        self.follower = Follower(config, store, self.replica_log, self.epochs, flusher,
                                 on_append)
        self._on_hw = on_hw
        self._follow_task: asyncio.Task[None] | None = None
        self._followed: LeaderRecord | None = None
        self._tick: asyncio.Task[None] | None = None
        self.leader_changes = 0  # terms observed (metrics)
        self._last_term: tuple[str, int] | None = None

    # ---------------------------------------------------------------- life cycle
    def start(self, port: int) -> None:
        cfg = self.config
        self.epochs.load()
        self.role = GroupRole(cfg.cluster, cfg.cluster_name, cfg.group, cfg.broker_id,
                              cfg.address(port), cfg.session_ttl_s,
                              on_elected=self._elected, on_step_down=self._stepped_down,
                              on_leader=self._observed, clean=not cfg.unclean_election)
        self.leading = LeaderReplication(cfg, self.store, self.role, self.replica_log,
                                         self.epochs, self._on_hw)
        self.role.start()
        self._tick = asyncio.get_running_loop().create_task(self._ticks())

    async def stop(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tick
        await self._stop_following()
        if self.role is not None:
            await self.role.stop()
        if self.leading is not None:
            self.leading.end()

    async def _ticks(self) -> None:
        period = min(0.25, self.config.replica_lag_max_ms / 4000)
        while True:
            await asyncio.sleep(period)
            if self.leading is not None and self.leading.tracker is not None:
                if self.is_leader():
                    self.leading.tick()
                else:  # the lease lapsed before the step-down callback ran
                    self.leading.end()

    # ---------------------------------------------------------------- role changes
    def is_leader(self) -> bool:
        return self.role is not None and self.role.is_leader()

    def _elected(self, term: Leadership) -> None:
        asyncio.get_running_loop().create_task(self._promote(term))

    async def _promote(self, term: Leadership) -> None:
        await self._stop_following()
        assert self.leading is not None and self.role is not None
        while True:  # the ISR the term starts from: read before any write is taken
            if not self.is_leader():
                return
            try:
                published, live = await self.role.term_start()
                break
            except (EtcdError, OSError) as exc:
                log.warning("group %s: cannot read the ISR: %s; retrying",
                            self.config.group, exc)
                await asyncio.sleep(0.1)
        if not self.is_leader():
            return
        self.leading.begin(term, self.follower.hw, published, live)
        log.warning("group %s: broker %s leads epoch %d from log end %d (high watermark "
                    "%d)", self.config.group, self.config.broker_id, term.epoch,
                    self.store.log.end, self.leading.hw)
        self.on_promoted()

    def _stepped_down(self, term: Leadership, why: str) -> None:
        if self.leading is not None:
            self.leading.end()

    def _observed(self, record: LeaderRecord) -> None:
        if self._last_term != (record.broker_id, record.epoch):
            self._last_term = (record.broker_id, record.epoch)
            self.leader_changes += 1
        if record.broker_id == self.config.broker_id:
            return
        if self.leading is not None and self.leading.tracker is not None:
            self.leading.end()
        if self._followed == record and self._follow_task is not None:
            return
        asyncio.get_running_loop().create_task(self._follow(record))

    async def _follow(self, record: LeaderRecord) -> None:
        await self._stop_following()
        if self.is_leader():
            return
        self._followed = record
        log.info("group %s: broker %s follows %s at %s (epoch %d)", self.config.group,
                 self.config.broker_id, record.broker_id, record.address, record.epoch)
        self._follow_task = asyncio.get_running_loop().create_task(self.follower.run(record))

    async def _stop_following(self) -> None:
        task, self._follow_task = self._follow_task, None
        self._followed = None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ---------------------------------------------------------------- per request
    def admit(self, code: int) -> None:
        """Raise ``NOT_LEADER`` (or ``NOT_ENOUGH_REPLICAS``) for a request this broker must
        not serve now."""
        if code in FOLLOWER_SERVES:
            return
        role, leading = self.role, self.leading
        if role is None or leading is None or leading.tracker is None or not role.is_leader():
            raise (role.not_leader() if role is not None else _starting())
        if code in CLIENT_WRITES:
            leading.check_write()

    def answer_epoch(self) -> int:
        """The epoch answers are tagged with: this broker's term while it leads, else 0."""
        leading = self.leading
        if leading is None or leading.tracker is None:
            return 0
        return leading.epoch

    def replicated(self, end: int) -> asyncio.Future[None] | None:
        assert self.leading is not None
        return self.leading.replicated(end)

    def visible_end(self, topic: str, queue: int) -> int | None:
        return None if self.leading is None else self.leading.visible_end(topic, queue)

    def log_grew(self) -> None:
        if self.leading is not None and self.leading.tracker is not None:
            self.leading.log_grew()

    def h_fetch(self, call: Call, req: object) -> None:
        assert self.leading is not None
        self.leading.h_fetch(call, req)  # type: ignore[arg-type]

    def h_epoch_end(self, call: Call, req: object) -> object:
        assert self.leading is not None
        return self.leading.h_epoch_end(call, req)  # type: ignore[arg-type]

    def status(self) -> dict[str, object]:
        """For ``BROKER_STATUS`` and logs: role, epoch, ISR, high watermark, lag."""
        leading = self.leading
        leader = self.is_leader() and leading is not None and leading.tracker is not None
        out: dict[str, object] = {"group": self.config.group,
                                  "broker_id": self.config.broker_id,
                                  "role": "leader" if leader else "follower",
                                  "log_end": self.store.log.end}
        if leader and leading is not None and leading.tracker is not None:
            out.update(epoch=leading.epoch, hw=leading.hw, isr=leading.in_sync(),
                       published_isr=list(leading.tracker.published),
                       lag=leading.tracker.lag(self.store.log.end))
        else:
            out.update(hw=self.follower.hw, problem=self.follower.problem,
                       leader=None if self.role is None else self.role.leader_address())
        return out


def _starting() -> OnceqError:
    return OnceqError(ErrorCode.NOT_LEADER, "the broker has not joined its group yet")
