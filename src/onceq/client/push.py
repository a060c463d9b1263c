"""Push consumer: the public facade that wires a coordinator, a fetcher and a consume
service around one listener.

The :class:`~onceq.client.coordinator.Coordinator` is the member of the group (heartbeats,
the rebalance and its order, reset notices, lock renewals) and owns the
:class:`~onceq.client.assignment.Assignment`; the :class:`~onceq.client.fetcher.Fetcher`
pulls each owned queue with long polling; the consume service (concurrent or orderly, see
``consume_service.py``) hands what was pulled to the listener through the
:class:`~onceq.client.runner.ListenerRunner`; offsets go to an offset store (the broker
for CLUSTERING, a local file for BROADCASTING, see ``offset_store.py``). Listener
middleware (``middleware.py``: the idempotency layer) wraps the listener at start.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..protocol.codes import retry_topic
from ..protocol.errors import OnceqError
from ..protocol.replies import RouteChanged
from . import middleware
from .allocation import MessageQueue
from .assignment import Assignment
from .base import BrokerClient, Connect
from .connection import BrokerConnection
from .consume import ConsumeContext, ConsumeResult, ConsumeStatus, Listener, is_orderly
from .consume_concurrent import ConcurrentConsumeService
from .consume_orderly import OrderlyConsumeService
from .consume_service import ConsumeService
from .coordinator import Coordinator
from .fetcher import Fetcher
from .local_offsets import LocalOffsetStore
from .offset_store import BrokerOffsets, LocalOffsets, OffsetStore
from .pull import default_client_id
from .push_config import MessageModel, PushConsumerConfig
from .responder import ReplySender
from .runner import ListenerRunner
from .security import ClientSecurity

log = logging.getLogger("onceq.consumer")

__all__ = ["ConsumeContext", "ConsumeResult", "ConsumeStatus", "Listener", "PushConsumer"]


class PushConsumer(BrokerClient):
    def __init__(self, address: str, group: str, listener: Listener | None = None,
                 config: PushConsumerConfig | None = None, *, client_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 connect: Connect | None = None, idempotency: Any = None,
                 security: ClientSecurity | None = None,
                 **overrides: Any) -> None:
        """``idempotency``: a dedup store URL, a ``DedupStore`` or an
        ``onceq.idempotency.Idempotency``: the listener runs once per dedup key (see
        docs/idempotency.md); ``idempotent_listener`` is then the guard (its ``stats``)."""
        super().__init__(address, connect, security)
        self.group = group
        self.config = config or PushConsumerConfig()
        for k, v in overrides.items():
            if not hasattr(self.config, k):
                raise TypeError(f"unknown consumer setting {k!r}")
            setattr(self.config, k, v)
        self.config.validate()
        self.client_id = client_id or default_client_id(self.config.instance_name)
        # BROADCASTING offsets file: must survive a restart, so not the default client id
        # (it holds the pid); like RocketMQ's ip@instanceName for broadcasting consumers
        self.offset_owner = client_id or f"{socket.gethostname()}#{self.config.instance_name}"
        self.clock = clock
        self._listener = listener
        self.idempotency = idempotency
        self.idempotent_listener: Any = None  # the guard around the listener (from start)
        self._subs: dict[str, str] = {}
        self.coordinator = Coordinator(group, self.client_id, self.config, clock, self._subs,
                                       self.orderly, self._call, lambda: self._conn)
        self.coordinator.route = self.links.route
        self.coordinator.broker_group = lambda: self.links.home
        self.coordinator.spawn = self._members_for
        # a topic over several broker groups: this consumer is a member of the group on
        # each of them (docs/cluster.md, "Consumer groups across broker groups"); the
        # consumer itself is the member on the group it reached, these on the others
        self.members: dict[str, PushConsumer] = {}
        # a member on another broker group: the consumer it belongs to (whose listener
        # runner, idempotency guard and routes it shares)
        self._owner: PushConsumer | None = None
        self.offsets: OffsetStore = BrokerOffsets(self.coordinator, self.owned)
        self.service: ConsumeService | None = None
        self.runner: ListenerRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._running = False

    # ================================================================ settings
    def subscribe(self, topic: str, expression: str = "*") -> None:
        """Consume ``topic``; ``expression`` is ``*`` or tags like ``TagA || TagB``."""
        self._subs[topic] = expression
        if self._running:
            self.rebalance_soon()

    def register_listener(self, listener: Listener) -> None:
        self._listener = listener

    @property
    def listener(self) -> Listener | None:
        """What consumes: the registered listener, or its idempotency guard."""
        return self.idempotent_listener or self._listener

    @property
    def clustering(self) -> bool:
        return self.config.model == MessageModel.CLUSTERING

    @property
    def orderly(self) -> bool:
        """Orderly consumption: by the ``orderly`` setting or an :func:`orderly` listener."""
        return self.config.orderly or is_orderly(self._listener)

    # ================================================================ state
    @property
    def owned(self) -> Assignment:
        """The queues this consumer owns now, with their process queues."""
        return self.coordinator.assignment

    @property
    def assignment(self) -> list[MessageQueue]:
        """The queues this consumer owns now (on every broker group)."""
        return [q for c in (self, *self.members.values()) for q in c.owned.queues()]

    @property
    def stats(self) -> Counter[str]:
        if not self.members:
            return self.coordinator.stats
        return sum((c.coordinator.stats for c in self.members.values()),
                   Counter(self.coordinator.stats))

    # ================================================================ lifecycle
    async def start(self) -> PushConsumer:  # type: ignore[override]
        if self._running:
            raise RuntimeError("the consumer is already started")
        if self._listener is None:
            raise ValueError("register a listener before start()")
        if not self._subs:
            raise ValueError("subscribe to a topic before start()")
        cfg = self.config
        if self.clustering:
            self._subs.setdefault(retry_topic(self.group), "*")
        if self.idempotency is not None:
            self.idempotent_listener = middleware.build("idempotency", self.idempotency
                                                        ).wrap(self._listener)
        listener = self.listener
        assert listener is not None
        runner = ListenerRunner.start(listener, cfg.concurrency, cfg.consume_timeout_s)
        await self._begin(runner, listener)
        return self

    async def _begin(self, runner: ListenerRunner, listener: Listener) -> None:
        """Wire the consume service, the fetcher and the coordinator around ``runner``,
        register with the broker and start the loops."""
        cfg = self.config
        coordinator = self.coordinator
        self.runner = runner
        if self.clustering:
            self.offsets = BrokerOffsets(coordinator, self.owned)
        else:
            self.offsets = LocalOffsets(LocalOffsetStore(cfg.offset_dir, self.offset_owner,
                                                         self.group))
        self.service = wire_service(self, self.runner)
        self.service.replier = ReplySender(lambda: self._conn, self.stats).send
        coordinator.orderly = self.orderly
        coordinator.offsets, coordinator.service = self.offsets, self.service
        coordinator.fetcher = Fetcher(coordinator, cfg, self.owned, self.offsets,
                                      self.service, self._subs)
        coordinator.begin()
        self._running = True
        self._no_reconnect = False
        try:
            await coordinator.heartbeat()
            # a listener may check its settings against the broker before consuming (the
            # idempotent wrapper checks its retention against the redelivery horizon)
            hook = getattr(listener, "on_consumer_start", None)
            if hook is not None and self._owner is None:
                await hook(self)
        except BaseException:  # e.g. no broker: leave nothing half started behind
            self._running = coordinator.running = False
            await self._close_guard()
            if self._conn is not None:
                self._conn.close()
            if self._owner is None:
                self.runner.shutdown()
            raise
        self._tasks = coordinator.start()
        self.service.start()

    async def _members_for(self, route: Any) -> None:
        """Start this consumer's member on each broker group of ``route`` it is not a
        member of yet (one that cannot start now is tried at the next rebalance). The
        consumer itself stays with the group it reached: given one group's brokers only."""
        home = self.links.home
        mine = (route.groups.get(home) or {}).get("members") or []
        if self.address in mine and set(mine) != set(self.route.addresses):
            self.route.addresses = [str(a) for a in mine]
        for name, where in route.groups.items():
            addresses = [str(a) for a in where.get("members") or []]
            if name == home or name in self.members or not self._running or not addresses:
                continue
            member = self._member(name, addresses)
            assert self.runner is not None and self.listener is not None
            try:
                await member._begin(self.runner, self.listener)
            except (OnceqError, OSError) as exc:
                log.warning("%s: cannot join group %s on broker group %s yet: %s",
                            self.client_id, self.group, name, exc)
                continue
            if not self._running:  # shut down meanwhile
                await member.shutdown()
                return
            self.members[name] = member
            log.info("%s: member of group %s on broker group %s too", self.client_id,
                     self.group, name)

    def _member(self, name: str, addresses: list[str]) -> PushConsumer:
        """This consumer's member on broker group ``name``: the same client id, listener,
        subscriptions and settings, its own connection, queues and offsets."""
        member = PushConsumer(",".join(addresses), self.group, self._listener, self.config,
                              client_id=self.client_id, clock=self.clock,
                              security=self.security)
        member._subs = self._subs
        member.coordinator.subscriptions = self._subs
        member.coordinator.route = self.links.route
        member.coordinator.broker_group = lambda: name
        member.coordinator.spawn = None
        member._owner = self
        member.offset_owner = f"{self.offset_owner}@{name}"
        return member

    async def __aenter__(self) -> PushConsumer:  # type: ignore[override]
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()

    async def close(self) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop pulling, let running listeners finish (bounded), commit, unregister."""
        if not self._running:
            return
        self._running = False
        members = list(self.members.values())
        await asyncio.gather(self.coordinator.leave(self._tasks),
                             *(m.shutdown() for m in members))
        self._no_reconnect = True  # late listener calls must not open a new connection
        if self._conn is not None:
            self._conn.close()
        if self.runner is not None and self._owner is None:
            self.runner.shutdown()
        await self._close_guard()

    async def _close_guard(self) -> None:
        """Close the store the idempotency option opened (the guard keeps its stats)."""
        if self.idempotent_listener is not None:
            await self.idempotent_listener.close()

    def rebalance_soon(self) -> None:
        """Have the rebalance loop run now (not after the interval)."""
        self.coordinator.rebalance_soon()
        for member in self.members.values():
            member.rebalance_soon()

    # ================================================================ connection events
    async def _on_connected(self, conn: BrokerConnection) -> None:
        await self.coordinator.on_connected(conn)

    def _on_push(self, code: int, header: dict[str, Any]) -> None:
        if code == RouteChanged.CODE:  # fetch the route again, and rebalance on it
            owner = self._owner or self
            topic = header.get("topic")
            if isinstance(topic, str) and topic in self._subs:
                owner.links.forget(topic)
                owner.rebalance_soon()
            return
        self.coordinator.on_push(code, header)


def wire_service(consumer: PushConsumer, runner: ListenerRunner) -> ConsumeService:
    """The consume service of ``consumer`` (orderly or concurrent), calling ``runner``."""
    kind = OrderlyConsumeService if consumer.orderly else ConcurrentConsumeService
    return kind(consumer.coordinator, consumer.config, consumer.owned, consumer.offsets,
                runner)
