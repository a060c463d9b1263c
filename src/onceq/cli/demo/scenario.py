"""One run of the demo's story, with its trouble, recording everything it measures.

Timeline (fractions of the orders produced): member ``A`` (in this process) and member
``K`` (a child process) consume from the start; ``B`` joins at 15%; ``K`` is SIGKILLed at
30%; the broker is SIGKILLed at 50% and restarted a second later; ``A`` leaves at 65%;
``C`` joins at 80%. Throughout, the proxy loses one send reply in ``lost_reply_every``
and the application re-sends ``resend_ratio`` of the orders (same order id and body, a new
unique key). Then the group drains. The run returns raw measurements (``RunData``);
``counting`` turns them into figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...client.admin import Admin
from ...client.message import Message, UniqueKeyGenerator
from ...client.producer import Producer
from ...client.push import PushConsumer
from ...protocol.errors import ErrorCode, OnceqError
from . import shop
from .member import GROUP, TOPIC, MemberSpec, build
from .trouble import BrokerProcess, ChildMember, ReplyDropProxy

# short retry delays so that messages consumed later come back within a second
DELAY_LEVELS = "100ms 200ms 300ms 500ms 1s 2s 5s 10s 30s 1m 2m 5m 10m 20m 30m 1h 2h 3h"


@dataclass
class RunConfig:
    workdir: str
    orders: int
    protected: bool
    queues: int = 8
    rate: float = 400.0  # orders per second the application produces
    lost_reply_every: int = 150  # one send reply in this many is lost
    resend_ratio: float = 0.01  # orders the application sends a second time
    seed: int = 12
    drain_timeout_s: float = 45.0
    work_ms: float = 2.0


@dataclass
class SendRecord:
    t: float
    order_id: str
    unique_key: str
    resend: bool
    duplicate: bool  # the broker answered "already stored" (a retry inside its window)
    queue: int
    offset: int
    app_retries: int  # sends the application repeated (broker unreachable)


@dataclass
class RunData:
    config: RunConfig
    t0: float
    t_produced: float = 0.0
    t_end: float = 0.0
    orders: list[shop.Order] = field(default_factory=list)
    sends: list[SendRecord] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    kills: dict[str, float] = field(default_factory=dict)  # member -> time of its SIGKILL
    broker_kills: list[float] = field(default_factory=list)
    lost_replies: list[float] = field(default_factory=list)
    lag_samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    stored: int = 0
    locked_pulls: int = 0  # pulls the access lock refused (members that exited cleanly)
    locked_pulls_live: int = 0  # the same, members still running included (progress)
    drained: bool = False


Progress = Callable[[RunData], None]


class Scenario:
    def __init__(self, cfg: RunConfig, progress: Progress | None = None) -> None:
        self.cfg = cfg
        self.progress = progress or (lambda data: None)
        wd = Path(cfg.workdir)
        (wd / "deliveries").mkdir(parents=True, exist_ok=True)
        shop.create(str(wd / "shop.db"))
        args = ["--delay-levels", DELAY_LEVELS, "--access-lock-restore-hold", "5"]
        if not cfg.protected:
            args += ["--dedup-window", "0", "--no-access-lock"]
        self.broker = BrokerProcess(str(wd / "broker"), args, str(wd / "broker.log"))
        rnd = random.Random(cfg.seed)
        self.data = RunData(cfg, time.time(), orders=shop.make_orders(cfg.orders, cfg.seed))
        # at least one lost reply and one re-send, however small the run
        self._lost_at = {n for n in range(1, cfg.orders + 1)
                         if rnd.random() < 1 / max(cfg.lost_reply_every, 1)} or {cfg.orders // 3}
        self._resend = {i for i in range(cfg.orders)
                        if rnd.random() < cfg.resend_ratio} or {cfg.orders // 2}
        self._members: dict[str, PushConsumer] = {}
        self._child: ChildMember | None = None
        self._produced = 0

    def event(self, label: str) -> None:
        self.data.events.append((time.time(), label))

    # ------------------------------------------------------------ members
    def _spec(self, name: str) -> MemberSpec:
        return MemberSpec(self.broker.address, self.cfg.workdir, name, self.cfg.protected,
                          self.cfg.work_ms)

    async def _join(self, name: str) -> None:
        consumer, _ = build(self._spec(name))
        await consumer.start()
        self._members[name] = consumer
        self.event(f"{name} joins")

    async def _leave(self, name: str) -> None:
        consumer = self._members.pop(name)
        await consumer.shutdown()
        self.data.locked_pulls += consumer.stats["locked"]
        self.event(f"{name} leaves")

    async def _start_child(self, name: str) -> None:
        args = ["--broker", self.broker.address, "--workdir", self.cfg.workdir,
                "--name", name, "--work-ms", str(self.cfg.work_ms)]
        if not self.cfg.protected:
            args.append("--unprotected")
        self._child = ChildMember(args, f"{self.cfg.workdir}/member-{name}.log")
        await self._child.start()
        self.event(f"{name} joins (child process)")

    async def _kill_child(self, name: str) -> None:
        assert self._child is not None
        await self._child.kill()
        self.data.kills[name] = time.time()
        self.event(f"{name} SIGKILLed")

    async def _kill_broker(self) -> None:
        self.broker.kill()
        self.data.broker_kills.append(time.time())
        self.event("broker SIGKILLed")
        await asyncio.sleep(1.0)
        await self.broker.start()
        self.event("broker restarted")

    # ------------------------------------------------------------ the run
    async def run(self, after: Callable[[str, RunData], Awaitable[None]] | None = None
                  ) -> RunData:
        cfg = self.cfg
        await self.broker.start()
        proxy = await ReplyDropProxy(self.broker.address,
                                     lambda n: n in self._lost_at).start()
        tasks: list[asyncio.Task[Any]] = []
        try:
            async with Admin(self.broker.address) as admin:
                await admin.create_topic(TOPIC, cfg.queues)
            self.data.t0 = time.time()
            await self._join("A")
            await self._start_child("K")
            timeline = asyncio.create_task(self._timeline())
            tasks = [asyncio.create_task(self._sample_lag()),
                     asyncio.create_task(self._report()), timeline]
            await self._produce(proxy.address)
            self.data.t_produced = time.time()
            await timeline
            self.data.lost_replies = list(proxy.dropped)
            self.data.drained = await self._drain()
            self.data.t_end = time.time()
            self.data.stored = await self._stored()
            for name in list(self._members):
                await self._leave(name)
            if after is not None:
                await after(self.broker.address, self.data)
        finally:
            for t in tasks:
                t.cancel()
            for name, consumer in list(self._members.items()):
                with contextlib.suppress(Exception):
                    await consumer.shutdown()
                self._members.pop(name)
            if self._child is not None:
                await self._child.stop()
            await proxy.close()
            self.broker.stop()
        return self.data

    async def _timeline(self) -> None:
        n = self.cfg.orders
        steps: list[tuple[float, Callable[[], Awaitable[None]]]] = [
            (0.15, lambda: self._join("B")),
            (0.30, lambda: self._kill_child("K")),
            (0.50, self._kill_broker),
            (0.65, lambda: self._leave("A")),
            (0.80, lambda: self._join("C")),
        ]
        for frac, step in steps:
            while self._produced < frac * n:
                await asyncio.sleep(0.02)
            await step()

    async def _produce(self, address: str) -> None:
        cfg = self.cfg
        keys = UniqueKeyGenerator()
        pending: list[tuple[int, shop.Order]] = []  # re-sends due later
        start = time.monotonic()
        async with Producer(address) as producer:
            for i, order in enumerate(self.data.orders):
                ahead = start + i / cfg.rate - time.monotonic()
                if ahead > 0:
                    await asyncio.sleep(ahead)
                await self._send(producer, order, keys.next(), resend=False)
                self._produced = i + 1
                if i in self._resend:
                    pending.append((i + max(cfg.orders // 20, 5), order))
                while pending and pending[0][0] <= i:
                    await self._send(producer, pending.pop(0)[1], keys.next(), resend=True)
            for _, order in pending:
                await self._send(producer, order, keys.next(), resend=True)

    async def _send(self, producer: Producer, order: shop.Order, unique_key: str, *,
                    resend: bool) -> None:
        msg = Message(order.body(), tags="created", keys=order.order_id, unique_key=unique_key)
        retries = 0
        deadline = time.monotonic() + 60
        while True:
            try:
                r = await producer.send(TOPIC, msg)
                break
            except OnceqError as exc:
                # the broker is down (restarting): the application sends the same message
                # again, same unique key, until it answers; a full disk does not pass
                if exc.code == ErrorCode.DISK_FULL or time.monotonic() > deadline:
                    raise
                retries += 1
                await asyncio.sleep(0.2)
        self.data.sends.append(SendRecord(time.time(), order.order_id, unique_key, resend,
                                          r.duplicate, r.queue_id, r.offset, retries))

    async def _group_lag(self, admin: Admin) -> dict[str, int]:
        status = await admin.group_status(GROUP)
        return {f"{q.topic}[{q.queue_id}]": q.lag for q in status.queues}

    async def _sample_lag(self) -> None:
        admin: Admin | None = None
        while True:
            try:
                if admin is None:
                    admin = Admin(self.broker.address)
                self.data.lag_samples.append((time.time(), await self._group_lag(admin)))
            except (OnceqError, OSError):
                if admin is not None:
                    with contextlib.suppress(Exception):
                        await admin.close()
                admin = None
            await asyncio.sleep(0.25)

    async def _report(self) -> None:
        while True:
            self.data.locked_pulls_live = self.data.locked_pulls + sum(
                c.stats["locked"] for c in self._members.values())
            self.progress(self.data)
            await asyncio.sleep(0.25)

    async def _drain(self) -> bool:
        """Wait until every order took effect and the group has nothing left to consume."""
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        want = {o.order_id for o in self.data.orders}
        db = f"{self.cfg.workdir}/shop.db"
        while time.monotonic() < deadline:
            lags = self.data.lag_samples[-1][1] if self.data.lag_samples else {"?": 1}
            if sum(lags.values()) == 0:
                rows, _ = shop.read_effects(db)
                if want <= {r[0] for r in rows}:
                    return True
            await asyncio.sleep(0.3)
        return False

    async def _stored(self) -> int:
        async with Admin(self.broker.address) as admin:
            return sum(hi - lo for lo, hi in await admin.topic_offsets(TOPIC))
