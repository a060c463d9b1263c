"""A member stopped (SIGSTOP) inside its listener for longer than its locks last, then
continued: a GC pause, a frozen VM, a laptop lid.

While it is stopped its heartbeat expires, the broker frees its access locks and the other
member consumes its queues to the end. When it continues, it must learn that the queues
are not its own any more before its listener sees another message: the committed offsets
never move back, and it delivers nothing again.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import signal
import subprocess
import sys

from onceq import Admin, Producer
from onceq.client.push import PushConsumer
from tests.helpers import running_broker

TOPIC = "paused"
GROUP = "paused-g"
QUEUES = 2
PER_QUEUE = 150
PROC = os.path.join(os.path.dirname(__file__), "..", "consumer_proc.py")
# short liveness so the pause outlasts the locks in a few seconds
BROKER = {"heartbeat_expiry_s": 1.5, "expiry_check_s": 0.1, "long_poll_max_s": 0.2,
          "access_lock_hold_s": 0.8}
FAST = {"heartbeat_interval_s": 0.2, "rebalance_interval_s": 0.5, "commit_interval_s": 0.1,
        "pull_suspend_s": 0.2}


async def _offsets(admin: Admin) -> list[int]:
    # nothing committed yet counts as 0: nothing consumed
    return [await admin.group_offset(GROUP, TOPIC, q) or 0 for q in range(QUEUES)]


async def _until(check, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_member_paused_past_its_locks_moves_no_offset_back_and_delivers_nothing_again(
        tmp_path):
    async with running_broker(str(tmp_path / "data"), **BROKER) as broker:
        addr = f"127.0.0.1:{broker.port}"
        admin = await Admin(addr).start()
        await admin.create_topic(TOPIC, QUEUES)
        async with Producer(addr) as p:
            for q in range(QUEUES):
                await p.send_batch(TOPIC, [f"{q}-{i}".encode() for i in range(PER_QUEUE)],
                                   queue=q)
        out = tmp_path / "paused.log"
        paused = subprocess.Popen(
            [sys.executable, PROC, "--addr", addr, "--group", GROUP, "--topic", TOPIC,
             "--out", str(out), "--instance", "paused", "--heartbeat-interval", "0.2",
             "--rebalance-interval", "0.5", "--commit-interval", "0.1", "--concurrency",
             "1", "--handler-ms", "5", "--pause-at", "10"],
            stdout=subprocess.PIPE, text=True)
        other = None
        try:
            assert (await asyncio.to_thread(paused.stdout.readline)).startswith("READY")
            line = await asyncio.to_thread(paused.stdout.readline)
            assert line.strip() == "IN-HANDLER", line
            paused.send_signal(signal.SIGSTOP)  # inside its listener, its cache full
            at_pause = out.read_text().split()[::2]
            assert len(at_pause) == 10

            seen: list[str] = []  # recorded here, asserted outside the listener
            other = PushConsumer(addr, GROUP, lambda msgs, ctx: seen.extend(
                m.unique_key for m in msgs), consume_from="FIRST", instance_name="other",
                **FAST)
            other.subscribe(TOPIC)
            await other.start()

            async def taken_over() -> bool:  # the paused member expired, all consumed
                members = await admin.group_members(GROUP)
                return (len(members) == 1 and members[0]["client"] == other.client_id
                        and await _offsets(admin) == [PER_QUEUE] * QUEUES)
            await _until(taken_over, 30, "the other member to consume everything")

            paused.send_signal(signal.SIGCONT)
            samples = [await _offsets(admin)]

            async def rebalanced() -> bool:  # the continued member is back and has a queue
                samples.append(await _offsets(admin))
                members = await admin.group_members(GROUP)
                holders = {lock["holder"] for lock in await admin.access_locks(GROUP)}
                return len(members) == 2 and len(holders) == 2
            await _until(rebalanced, 30, "the continued member to rejoin")
            for _ in range(40):  # and a while longer: its periodic commits have run
                samples.append(await _offsets(admin))
                await asyncio.sleep(0.05)
        finally:
            paused.send_signal(signal.SIGCONT)
            paused.send_signal(signal.SIGTERM)
            await asyncio.to_thread(paused.wait, 30)
            if other is not None:
                await other.shutdown()
            await admin.close()

        for q in range(QUEUES):  # the committed offsets never went back
            series = [s[q] for s in samples]
            assert all(a <= b for a, b in itertools.pairwise(series)), series
            assert series[-1] == PER_QUEUE
        delivered = out.read_text().split()[::2]
        assert delivered[:10] == at_pause
        assert delivered[10:] == [], "the continued member delivered again"
        counts = collections.Counter(seen)
        assert max(counts.values()) == 1  # the other member saw each message once
        assert len(set(counts) | set(at_pause)) == QUEUES * PER_QUEUE  # nothing lost
