"""Broker SIGKILLed and restarted while a consumer group consumes through the access lock.

The broker runs in a child process (``--flush sync``); three push consumers (lock on) run in
this process and record every delivery; the assertions run outside the listeners. One
member reaches the broker through a proxy that keeps it away for a few seconds after the
restart, so the others come back first and see a group without it (as when members run
on several hosts). After the restart the group must carry on where it was: nothing lost,
and a message delivered twice only if it was in a listener at the instant of the kill (0
when the group was idle).
"""

from __future__ import annotations

import asyncio
import collections
import random
import signal

import pytest

from onceq import Admin, Producer
from onceq.client.push import PushConsumer
from tests.helpers import free_port, spawn_broker

TOPIC = "rs"
GROUP = "rs-g"
QUEUES = 8


LATE_S = 3.0  # the proxied member reconnects this long after the broker is back


class Proxy:
    """TCP relay to the broker; while closed it drops new connections at once."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.open = True
        self.server: asyncio.AbstractServer | None = None
        self.address = ""

    async def start(self) -> Proxy:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _accept(self, reader, writer) -> None:
        if not self.open:
            writer.close()
            return
        host, port = self.upstream.rsplit(":", 1)
        try:
            up_r, up_w = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer))

    @staticmethod
    async def _pipe(reader, writer) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


class Recorder:
    """Deliveries and the messages inside listeners right now (no asserts in here)."""

    def __init__(self) -> None:
        self.deliveries: list[tuple[str, str]] = []  # (unique key, consumer)
        self.inflight: set[tuple[str, str]] = set()

    def listener(self, name: str, handler_s: float):
        async def handle(msgs, ctx):
            for m in msgs:
                self.inflight.add((m.unique_key, name))
            await asyncio.sleep(handler_s * random.uniform(0.5, 1.5))
            for m in msgs:
                self.deliveries.append((m.unique_key, name))
                self.inflight.discard((m.unique_key, name))
        return handle


async def _produce(addr: str, n: int) -> list[str]:
    keys: list[str] = []
    async with Producer(addr) as p:
        for i in range(0, n, 50):
            rs = await p.send_batch(TOPIC, [f"m{j}".encode() for j in range(i, i + 50)],
                                    queue=(i // 50) % QUEUES)
            keys.extend(r.unique_key for r in rs)
    return keys


async def _start_group(addr: str, late_addr: str, rec: Recorder, handler_s: float,
                       concurrency: int = 20) -> list[PushConsumer]:
    members = []
    for name in ("c1", "c2", "c3"):
        c = PushConsumer(late_addr if name == "c3" else addr, GROUP,
                         rec.listener(name, handler_s), consume_from="FIRST",
                         instance_name=name, access_lock=True, rebalance_interval_s=2,
                         pull_suspend_s=1, commit_interval_s=0.5, concurrency=concurrency)
        c.subscribe(TOPIC)
        members.append(await c.start())
    return members


async def _busy_and_settled(members: list[PushConsumer], rec: Recorder) -> None:
    """Until the group shares the queues 3/3/2, a third of the messages are handled and
    listeners are busy: the moment to kill the broker."""
    def mine(c: PushConsumer) -> list:
        return [q for q in c.assignment if q.topic == TOPIC]  # not the retry topic

    while not (sorted(len(mine(c)) for c in members) == [2, 3, 3]
               and len({q for c in members for q in mine(c)}) == QUEUES
               and len(rec.deliveries) >= 1200 and len(rec.inflight) >= 6):
        await asyncio.sleep(0.001)


async def _caught_up(addr: str, keys: list[str], rec: Recorder, timeout: float,
                     poll_s: float = 0.1) -> bool:
    """Every key delivered and the group's committed offsets at the end of every queue."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    want = set(keys)
    while loop.time() < deadline:
        if want <= {k for k, _ in rec.deliveries}:
            try:
                async with Admin(addr) as admin:
                    ends = await admin.topic_offsets(TOPIC)
                    committed = [await admin.group_offset(GROUP, TOPIC, q)
                                 for q in range(QUEUES)]
                if committed == [hi for _lo, hi in ends]:
                    return True
            except OSError:
                pass
        await asyncio.sleep(poll_s)
    return False


def _kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


async def _restart(proc, data: str, port: int, proxy: Proxy):
    """SIGKILL the broker (the caller just took its figures), start it again; the proxied
    member gets through ``LATE_S`` seconds after the others."""
    proxy.open = False
    await asyncio.to_thread(_kill, proc)
    proc, _ = await asyncio.to_thread(spawn_broker, data, "--flush", "sync", port=port)
    await asyncio.sleep(LATE_S)  # the scenario: a member slower to come back
    proxy.open = True
    return proc


def _count(rec: Recorder, keys: list[str]) -> tuple[int, int]:
    per_key = collections.Counter(k for k, _ in rec.deliveries)
    lost = len(set(keys) - set(per_key))
    dups = sum(n - 1 for n in per_key.values())
    return lost, dups


@pytest.mark.slow
async def test_restart_while_consuming_loses_nothing_and_repeats_only_inflight(tmp_path):
    data, port = str(tmp_path / "data"), free_port()
    proc, addr = spawn_broker(data, "--flush", "sync", port=port)
    proxy = await Proxy(addr).start()
    members: list[PushConsumer] = []
    try:
        async with Admin(addr) as admin:
            await admin.create_topic(TOPIC, QUEUES)
        keys = await _produce(addr, 6000)
        rec = Recorder()
        members = await _start_group(addr, proxy.address, rec, handler_s=0.02,
                                     concurrency=4)
        await asyncio.wait_for(_busy_and_settled(members, rec), 60)
        in_handlers = len(rec.inflight)  # the instant of the kill: nothing awaits between
        delivered_at_kill = len(rec.deliveries)
        before = [(c.assignment, c.stats["revoked"]) for c in members]
        proc = await _restart(proc, data, port, proxy)
        caught_up = await _caught_up(addr, keys, rec, timeout=90)
        after = [(c.assignment, c.stats["revoked"]) for c in members]
        resent = sum(c.stats["offsets_resent"] for c in members)
    finally:
        for c in members:
            await c.shutdown()
        proxy.close()
        proc.kill()
        proc.wait()
    lost, dups = _count(rec, keys)
    assert caught_up, f"the group did not catch up: lost={lost}"
    assert delivered_at_kill < len(keys) and in_handlers >= 6  # killed mid-run
    # every member kept its queues through the restart (no revoke), the late one too
    assert after == before
    assert lost == 0
    assert dups <= in_handlers, (f"{dups} duplicate deliveries, {in_handlers} messages "
                                 f"in listeners at the kill; offsets re-sent: {resent}")
    print(f"restart mid-run: in handlers at kill={in_handlers} duplicates={dups} "
          f"offsets re-sent={resent}")


@pytest.mark.slow
async def test_restart_while_the_group_is_idle_repeats_nothing(tmp_path):
    data, port = str(tmp_path / "data"), free_port()
    proc, addr = spawn_broker(data, "--flush", "sync", port=port)
    proxy = await Proxy(addr).start()
    members: list[PushConsumer] = []
    try:
        async with Admin(addr) as admin:
            await admin.create_topic(TOPIC, QUEUES)
        keys = await _produce(addr, 800)
        rec = Recorder()
        members = await _start_group(addr, proxy.address, rec, handler_s=0.001)
        assert await _caught_up(addr, keys, rec, timeout=60, poll_s=0.01)
        in_handlers = len(rec.inflight)
        # killed right after the last commits: the broker's periodic offsets snapshot may
        # not have them, the consumers' process queues do
        proc = await _restart(proc, data, port, proxy)
        keys += await _produce(addr, 800)
        caught_up = await _caught_up(addr, keys, rec, timeout=90)
    finally:
        for c in members:
            await c.shutdown()
        proxy.close()
        proc.kill()
        proc.wait()
    lost, dups = _count(rec, keys)
    assert in_handlers == 0
    assert caught_up, f"the group did not catch up: lost={lost}"
    assert lost == 0
    assert dups == 0
