"""Queues that follow the group, end to end: a group grows 1 -> 8 members and back to 1
while a producer sends keyed messages. Nothing is lost, no message is delivered twice
(graceful joins and leaves under the access lock), and each key is consumed in send order
across every change of the queue counts (docs/queue_scaling.md: key order is kept across
changes when the topic keeps it, the default).

Listeners only record; everything is asserted here, outside them.
"""

from __future__ import annotations

import asyncio
import collections
import time

from onceq import Admin, Producer
from onceq.client.consume import orderly
from onceq.client.push import PushConsumer
from tests.helpers import running_broker, wait_until

TOPIC, GROUP = "scaled", "scaled-g"
KEYS = [f"k{i}" for i in range(24)]


async def _produce(addr: str, stop: asyncio.Event, sent: dict[str, list[str]],
                   counts: list[int]) -> None:
    """Keyed sends, each awaited (the producer's order for a key), cycling the keys."""
    async with Producer(addr, send_timeout=10) as p:
        p.queue_refresh_s = 0.2  # below the broker's grace (1 s) as the defaults are
        seq = collections.Counter()
        while not stop.is_set():
            for key in KEYS:
                r = await p.send(TOPIC, f"{key} {seq[key]}", sharding_key=key)
                sent[key].append(r.unique_key)
                seq[key] += 1
            counts.append(await p.queue_count(TOPIC))
            await asyncio.sleep(0.03)  # about 600 messages a second


def _member(addr: str, name: str, log: list[tuple[str, int, str, int]]) -> PushConsumer:
    @orderly
    async def listener(msgs, ctx):
        await asyncio.sleep(0.003 * len(msgs))  # slower than the producer: a backlog
        for m in msgs:
            key, seq = m.body.decode().split()
            log.append((key, int(seq), m.unique_key, ctx.queue))

    c = PushConsumer(addr, GROUP, listener, consume_from="FIRST", instance_name=name,
                     rebalance_interval_s=1, heartbeat_interval_s=0.5, pull_suspend_s=0.5,
                     commit_interval_s=0.2, lock_retry_s=0.1)
    c.subscribe(TOPIC)
    return c


async def _settled(admin: Admin, members: int, log: list, counts: list) -> dict:
    """Wait until the topic reads and writes ``members`` queues (nothing draining, no gate)
    while messages are still consumed."""
    async def done() -> bool:
        s = await admin.topic_scaling(TOPIC)
        return (s["read"] == s["write"] == members and not s["draining"]
                and not s["gates"])
    await wait_until(done, 30, f"the topic to settle on {members} queue(s)", interval=0.1)
    mark = len(log)
    await wait_until(lambda: len(log) > mark + len(KEYS), 20, "consumption going on")
    return await admin.topic_scaling(TOPIC)


async def test_group_grows_to_eight_and_back_under_load(tmp_path, key_order=True):
    t0 = time.monotonic()
    async with running_broker(str(tmp_path / "data"), queue_scaling_grace_s=1.0,
                              queue_scaling_settle_s=0.3,
                              access_lock_restore_hold_s=0.5) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.follow_group(TOPIC, GROUP, min_queues=1, max_queues=8,
                                     key_order=key_order)
            sent: dict[str, list[str]] = collections.defaultdict(list)
            log: list[tuple[str, int, str, int]] = []
            counts: list[int] = []
            stop = asyncio.Event()
            members = [await _member(addr, "c0", log).start()]
            prod = asyncio.create_task(_produce(addr, stop, sent, counts))
            seen_layouts = [await _settled(admin, 1, log, counts)]
            for target in (2, 4, 8, 4, 2, 1):
                while len(members) < target:
                    members.append(await _member(addr, f"c{len(members)}", log).start())
                while len(members) > target:
                    await members.pop().shutdown()
                seen_layouts.append(await _settled(admin, target, log, counts))
                print(f"{target}: {time.monotonic() - t0:.1f}s sent "
                      f"{sum(map(len, sent.values()))} consumed {len(log)}")
            stop.set()
            await prod
            every = {uk for uks in sent.values() for uk in uks}
            await wait_until(lambda: every <= {e[2] for e in log}, 30, "every message consumed")
            final = await admin.topic_scaling(TOPIC)
            for m in members:
                await m.shutdown()

    # every sent message consumed
    consumed = collections.Counter(e[2] for e in log)
    assert every - set(consumed) == set()
    # no message delivered twice: graceful joins and leaves under the access lock and the
    # orderly lock (the offset is committed before a queue is unlocked)
    dups = {uk: n for uk, n in consumed.items() if n > 1}
    assert not dups, f"{len(dups)} message(s) delivered more than once"
    # each key in send order across every change of the counts: the first delivery of
    # each message comes after the first delivery of the key's previous message
    firsts: dict[str, list[int]] = collections.defaultdict(list)
    seen: set[str] = set()
    for key, seq, uk, _queue in log:
        if uk not in seen:
            seen.add(uk)
            firsts[key].append(seq)
    for key in KEYS:
        assert firsts[key] == list(range(len(sent[key]))), key
    # the counts did follow the group: the producer wrote 1, then up to 8, then 1 queue
    assert {1, 8} <= set(counts)
    assert [s["write"] for s in seen_layouts] == [1, 2, 4, 8, 4, 2, 1]
    assert final["read"] == final["write"] == 1
    assert final["changes"] >= 6
    # keys did move between queues (else the order check would prove nothing)
    queues_of = collections.defaultdict(set)
    for key, _seq, _uk, queue in log:
        queues_of[key].add(queue)
    assert sum(len(qs) > 1 for qs in queues_of.values()) >= len(KEYS) // 2, queues_of
    print(f"{len(every)} messages, {len(KEYS)} keys, changes={final['changes']}, "
          f"{time.monotonic() - t0:.1f}s")
