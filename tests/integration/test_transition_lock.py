"""Transition-state queue lock end to end: no duplicate delivery on rebalance."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

from onceq import Admin, Producer
from onceq.client.allocation import MessageQueue
from onceq.client.connection import BrokerConnection
from onceq.client.push import PushConsumer
from onceq.protocol.codes import PullStatus, RequestCode
from tests.handover import moved
from tests.helpers import running_broker, wait_until

TOPIC = "tl"
QUEUES = 8


async def _produce(addr: str, stop: asyncio.Event, keys: list[str]) -> None:
    async with Producer(addr) as p:
        i = 0
        while not stop.is_set():
            rs = await p.send_batch(TOPIC, [f"m{i}-{j}".encode() for j in range(10)])
            keys.extend(r.unique_key for r in rs)
            i += 1
            await asyncio.sleep(0.01)


def _consumer(addr: str, name: str, seen: dict, deliveries: list | None = None, **kw
              ) -> PushConsumer:
    async def listener(msgs, ctx):
        await asyncio.sleep(0.002)  # a handler taking a little time widens the race
        for m in msgs:
            seen[m.unique_key].append(name)
            if deliveries is not None:
                deliveries.append((ctx.queue, m.queue_offset, name))

    c = PushConsumer(addr, "tl-g", listener, consume_from="FIRST", instance_name=name,
                     rebalance_interval_s=1, pull_suspend_s=1, **kw)
    c.subscribe(TOPIC)
    return c


async def _wait_all(keys: list[str], seen: dict, timeout: float = 20) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline and not set(keys) <= set(seen):
        await asyncio.sleep(0.1)


async def _settled(members: list[PushConsumer], names: list[str], deliveries: list,
                   mark: int) -> None:
    """Wait until ``members`` split every queue and each consumed every queue it owns
    (``deliveries`` after index ``mark``): the handovers of a step are done while messages
    flow."""
    def done() -> bool:
        if not members:
            return True
        owned = [mq for m in members for mq in m.assignment if mq.topic == TOPIC]
        if len(owned) != QUEUES or len(set(owned)) != QUEUES:
            return False
        got = {(mq, name) for mq, _, name in deliveries[mark:]}
        return all((mq, name) in got for m, name in zip(members, names, strict=True)
                   for mq in m.assignment if mq.topic == TOPIC)

    await wait_until(done, 20, "every queue consumed by its new holder")


@dataclass
class Run:
    lost: int
    duplicates: int
    moved: dict  # queue -> members that consumed it, in offset order
    locks_held: int  # queues the broker's access lock held at the end, before shutdown


async def _join_leave(tmp_path, access_lock: bool) -> Run:
    """Members join and leave gracefully while messages flow."""
    async with running_broker(str(tmp_path / f"data-{access_lock}")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic(TOPIC, QUEUES)
        seen: dict[str, list[str]] = collections.defaultdict(list)
        deliveries: list[tuple] = []
        keys: list[str] = []
        stop = asyncio.Event()
        prod = asyncio.create_task(_produce(addr, stop, keys))

        def member(name: str) -> PushConsumer:
            return _consumer(addr, name, seen, deliveries, access_lock=access_lock)

        members = [await member("c0").start()]
        names = ["c0"]
        mark = 0
        for step in range(1, 7):  # grow to 3, shrink to none, then a new member joins
            await _settled(members, names, deliveries, mark)
            mark = len(deliveries)
            if step in (1, 2, 6):
                members.append(await member(f"c{step}").start())
                names.append(f"c{step}")
            else:
                await members.pop(0).shutdown()
                names.pop(0)
        await _settled(members, names, deliveries, mark)
        stop.set()
        await prod
        await _wait_all(keys, seen)
        locks_held = len(await _locks(addr))
        for m in members:
            await m.shutdown()
    return Run(lost=len(set(keys) - set(seen)),
               duplicates=sum(len(v) - 1 for v in seen.values()),
               moved=moved(deliveries), locks_held=locks_held)


def _check_handovers(run: Run) -> None:
    # c0, c1 and c2 left while messages flowed, so every queue changed holder at least
    # once; a zero-duplicate figure without handovers would prove nothing
    assert run.moved, "no queue changed holder during the run"
    assert len(run.moved) == QUEUES, run.moved


async def test_no_duplicates_on_rebalance_with_the_lock(tmp_path):
    run = await _join_leave(tmp_path, access_lock=True)
    assert run.lost == 0
    _check_handovers(run)
    assert run.locks_held > 0  # the broker applied the lock to the members
    assert run.duplicates == 0
    print(f"lock on: lost=0 duplicates=0, {len(run.moved)} queues moved")


async def test_without_the_lock_nothing_is_lost(tmp_path):
    run = await _join_leave(tmp_path, access_lock=False)
    assert run.lost == 0
    _check_handovers(run)
    assert run.locks_held == 0  # the members switched the lock off
    # the duplicate count without the lock depends on timing (0 is possible): printed, not
    # asserted; test_push_consumer.py compares lock on and off where it is deterministic
    print(f"lock off: lost=0 duplicates={run.duplicates}, {len(run.moved)} queues moved")


async def test_sigkilled_holder_messages_are_redelivered(tmp_path):
    async with running_broker(str(tmp_path / "data")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic(TOPIC, QUEUES)
        out = tmp_path / "victim.log"
        victim = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(__file__), "..", "consumer_proc.py"),
             "--addr", addr, "--group", "tl-g", "--topic", TOPIC, "--out", str(out),
             "--instance", "victim", "--rebalance-interval", "1"],
            stdout=subprocess.PIPE, text=True)
        try:
            line = await asyncio.to_thread(victim.stdout.readline)
            assert line.startswith("READY")
            seen: dict[str, list[str]] = collections.defaultdict(list)
            keys: list[str] = []
            stop = asyncio.Event()
            prod = asyncio.create_task(_produce(addr, stop, keys))
            await wait_until(lambda: out.exists() and out.stat().st_size > 0, 10,
                             "the victim to consume")
            survivor = await _consumer(addr, "survivor", seen).start()
            await wait_until(lambda: len(survivor.assignment) > 0 and seen, 10,
                             "the survivor to consume its share")

            async def both_hold() -> bool:
                return len({r["holder"] for r in await _locks(addr)}) == 2

            await wait_until(both_hold, 10, "the victim and the survivor to hold queues")
            victim.send_signal(signal.SIGKILL)  # its in-flight, uncommitted messages ...
            victim.wait()
            mark = len(keys)
            all_queues = {MessageQueue(TOPIC, q) for q in range(QUEUES)}
            await wait_until(lambda: {mq for mq in survivor.assignment
                                      if mq.topic == TOPIC} == all_queues, 10,
                             "the survivor to take every queue")
            # messages keep flowing while it does, and after
            await wait_until(lambda: len(keys) >= mark + 200, 10, "more messages")
            stop.set()
            await prod
            with open(out) as f:
                for ln in f:
                    seen[ln.split()[0]].append("victim")
            await _wait_all(keys, seen)
            # ... are redelivered to the survivor, which holds every queue now
            assert {r["holder"] for r in await _locks(addr)} == {survivor.client_id}
            await survivor.shutdown()
        finally:
            if victim.poll() is None:
                victim.kill()
    assert not set(keys) - set(seen), "messages lost after the holder was killed"


async def _locks(addr: str) -> list[dict]:
    async with Admin(addr) as admin:
        return await admin.access_locks("tl-g")


async def test_release_after_a_held_takeover_pull_does_not_move_the_offset_back(tmp_path):
    """A member takes a queue over while it is idle: its pull is corrected forward to the
    group's offset and held (long polling), so the member never learns the correction. If it
    must give the queue up before that pull returns, its release carries its stale, lower
    start offset; committing it would move the group back and repeat messages."""
    async with running_broker(str(tmp_path / "data")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic(TOPIC, 1)
        async with Producer(addr) as p:
            await p.send_batch(TOPIC, [b"a", b"b"], queue=0)
        conns = []
        try:
            for client in ("old", "new"):
                conn = await BrokerConnection.open(addr)
                conns.append(conn)
                await conn.request(RequestCode.HEARTBEAT, {"client": client, "groups": [
                    {"group": "tl-g", "model": "CLUSTERING", "subs": {TOPIC: "*"}}]})
            old, new = conns
            pull = {"group": "tl-g", "topic": TOPIC, "queue": 0, "max": 32}
            hdr, _ = await old.request(RequestCode.PULL, {**pull, "client": "old", "offset": 0})
            assert hdr["st"] == PullStatus.FOUND and hdr["next"] == 2
            # "new" looked the offset up before "old" committed: it starts at 0
            hdr, _ = await new.request(RequestCode.PULL, {**pull, "client": "new", "offset": 0})
            assert hdr["st"] == PullStatus.LOCKED
            await old.request(RequestCode.RELEASE_QUEUE, {"group": "tl-g", "client": "old",
                                                          "topic": TOPIC, "queue": 0,
                                                          "offset": 2})
            held = new.send_request(RequestCode.PULL, {**pull, "client": "new", "offset": 0,
                                                       "suspend_ms": 5000})
            # the broker holds it (long polling) ...
            await wait_until(lambda: b.holds.holders_of((TOPIC, 0)), 5, "the pull held")
            assert not held.done()  # corrected to 2 and held: nothing new to read
            hdr, _ = await new.request(RequestCode.RELEASE_QUEUE, {
                "group": "tl-g", "client": "new", "topic": TOPIC, "queue": 0, "offset": 0})
            assert hdr["released"] is True
            assert b.store.get_offset("tl-g", TOPIC, 0) == 2
        finally:
            for conn in conns:
                conn.close()


async def test_a_takeover_pull_does_not_commit_its_stale_start_offset(tmp_path):
    """A member that started from the consume-from policy sends that start as a commit on its
    pulls. When its first granted pull takes the queue over, the read is corrected forward to
    the group's offset; the commit it carries is older still and must not move it back."""
    async with running_broker(str(tmp_path / "data")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic(TOPIC, 1)
        async with Producer(addr) as p:
            await p.send_batch(TOPIC, [b"a", b"b", b"c"], queue=0)
        conns = []
        try:
            for client in ("old", "new"):
                conn = await BrokerConnection.open(addr)
                conns.append(conn)
                await conn.request(RequestCode.HEARTBEAT, {"client": client, "groups": [
                    {"group": "tl-g", "model": "CLUSTERING", "subs": {TOPIC: "*"}}]})
            old, new = conns
            pull = {"group": "tl-g", "topic": TOPIC, "queue": 0, "max": 32}
            hdr, _ = await old.request(RequestCode.PULL, {**pull, "client": "old", "offset": 0,
                                                          "commit": 0})
            assert hdr["st"] == PullStatus.FOUND and hdr["next"] == 3
            await old.request(RequestCode.RELEASE_QUEUE, {"group": "tl-g", "client": "old",
                                                          "topic": TOPIC, "queue": 0,
                                                          "offset": 3})
            async with Producer(addr) as p:
                await p.send(TOPIC, b"d", queue=0)
            # "new" found no offset earlier and started at 0 (consume from FIRST)
            hdr, _ = await new.request(RequestCode.PULL, {**pull, "client": "new", "offset": 0,
                                                          "commit": 0})
            assert hdr["st"] == PullStatus.FOUND and hdr["n"] == 1  # read from 3: only "d"
            assert b.store.get_offset("tl-g", TOPIC, 0) == 3
        finally:
            for conn in conns:
                conn.close()
