"""A broker group of three child brokers on one private etcd: one leader, NOT_LEADER from
the followers, acks=all replication byte for byte, pulls bounded by the high watermark,
min_insync, and a SIGKILL failover that keeps every acknowledged message and answers a
producer's retry as a duplicate."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from onceq.client.pull import PullConsumer
from onceq.protocol.codes import PullStatus
from onceq.protocol.errors import ErrorCode, OnceqError
from tests.cluster.group import Node, leader_of, pull_all, send, status
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(60)


def test_leader_followers_and_replication(group: list[Node]) -> None:
    async def go() -> None:
        leader = await leader_of(group, isr=3)
        followers = [n for n in group if n is not leader]
        # a follower refuses client writes and pulls, naming the leader
        with pytest.raises(OnceqError) as err:
            await send(followers[0].address, "t", "x", "k-x")
        assert err.value.code == ErrorCode.NOT_LEADER
        assert err.value.details["leader"] == leader.address
        assert leader.address in err.value.message
        # acks=all: every acknowledged message is on all three logs, byte for byte
        for i in range(20):
            await send(leader.address, "t", f"m{i}", f"k{i}")
        st = await status(leader)
        assert st is not None and st["hw"] == st["log_end"]
        end = st["log_end"]

        async def same() -> bool:
            return all(n.log_bytes(end) == group[0].log_bytes(end) for n in group) and len(
                group[0].log_bytes(end)) == end

        await wait_until(same, 5, "three equal logs")
        assert await pull_all(leader.address, "t") == [f"m{i}".encode() for i in range(20)]

    asyncio.run(go())


def test_isr_shrinks_and_min_insync(group: list[Node]) -> None:
    """SIGSTOP one follower: the ISR shrinks to two, writes go on (min_insync 2); stop the
    other: writes are refused NOT_ENOUGH_REPLICAS; SIGCONT: they are accepted again. Pulls
    never return what is above the high watermark."""

    async def go() -> None:
        leader = await leader_of(group, isr=3)
        f1, f2 = [n for n in group if n is not leader]
        await send(leader.address, "t", "m0", "k0")
        f1.signal(signal.SIGSTOP)

        async def isr(n: int) -> bool:
            st = await status(leader)
            return st is not None and len(st["isr"]) == n

        await wait_until(lambda: isr(2), 5, "the ISR shrinks to 2")
        await send(leader.address, "t", "m1", "k1")
        f2.signal(signal.SIGSTOP)
        await wait_until(lambda: isr(1), 5, "the ISR shrinks to 1")
        with pytest.raises(OnceqError) as err:
            await send(leader.address, "t", "m2", "k2")
        assert err.value.code == ErrorCode.NOT_ENOUGH_REPLICAS
        assert err.value.retriable
        f1.signal(signal.SIGCONT)
        f2.signal(signal.SIGCONT)
        await wait_until(lambda: isr(3), 10, "the followers back in sync")
        assert await send(leader.address, "t", "m3", "k3") >= 0
        bodies = await pull_all(leader.address, "t")
        assert bodies[:2] == [b"m0", b"m1"] and bodies[-1] == b"m3"

    asyncio.run(go())


def test_pulls_stop_at_the_high_watermark(group: list[Node]) -> None:
    """acks=all with a write stuck below min_insync: the record is in the leader's log, but
    a pull does not return it until the followers have it."""

    async def go() -> None:
        leader = await leader_of(group, isr=3)
        f1, f2 = [n for n in group if n is not leader]
        await send(leader.address, "t", "m0", "k0")
        for f in (f1, f2):
            f.signal(signal.SIGSTOP)
        try:
            # sent before the ISR shrinks: stored by the leader, not replicated
            with pytest.raises(OnceqError) as err:
                await send(leader.address, "t", "m1", "k1")
            assert err.value.code == ErrorCode.NOT_ENOUGH_REPLICAS
            st = await status(leader)
            assert st is not None
            async with PullConsumer(leader.address, "g") as c:
                r = await c.pull("t", 0, 0, 64)
                assert [m.body for m in r.messages] == [b"m0"]
                assert r.max_offset == 1
                r = await c.pull("t", 0, 1, 64)
                assert r.status == PullStatus.NO_NEW_MESSAGE
        finally:
            for f in (f1, f2):
                f.signal(signal.SIGCONT)

        async def visible() -> bool:
            return await pull_all(leader.address, "t") == [b"m0", b"m1"]

        await wait_until(visible, 10, "m1 visible once replicated")

    asyncio.run(go())


def test_failover_keeps_acknowledged_and_dedups_retries(group: list[Node]) -> None:
    """SIGKILL the leader: a follower leads with a higher epoch, serves every acknowledged
    message, and answers a retry of an acknowledged unique key as a duplicate."""

    async def go() -> None:
        leader = await leader_of(group, isr=3)
        st = await status(leader)
        assert st is not None
        epoch = st["epoch"]
        offsets = [await send(leader.address, "t", f"m{i}", f"k{i}") for i in range(10)]
        assert offsets == list(range(10))
        t0 = time.monotonic()
        leader.kill()
        rest = [n for n in group if n is not leader]
        new = await leader_of(rest, timeout=15)
        took = time.monotonic() - t0
        st = await status(new)
        assert st is not None and st["epoch"] > epoch
        assert took < 10
        # every acknowledged message, once (visible as soon as the new leader's high
        # watermark reaches it: the other follower fetched, the ISR without the dead
        # leader is published)
        async def all_acked() -> bool:
            return await pull_all(new.address, "t") == [f"m{i}".encode() for i in range(10)]

        await wait_until(all_acked, 5, "every acknowledged message on the new leader")
        # a producer's retry of an acknowledged send: a duplicate at the first copy's offset
        assert await send(new.address, "t", "m7", "k7", retries=5) == -1 - 7
        # and new writes go on (the ISR needs the other follower back: min_insync 2)
        assert await send(new.address, "t", "m10", "k10", retries=5) == 10

    asyncio.run(go())


def test_returning_leader_cuts_its_divergent_tail(unclean_group: list[Node]) -> None:
    """A leader alone in its ISR stores an offset commit its followers never fetch (the
    commit is answered NOT_ENOUGH_REPLICAS) and is killed; the followers, out of the ISR,
    may lead only because elections are unclean here. Back under the new leader the old
    one cuts that tail and follows: the three logs are equal again, and the cut commit is
    nowhere."""
    group = unclean_group

    async def go() -> None:
        old = await leader_of(group, isr=3)
        f1, f2 = [n for n in group if n is not old]
        await send(old.address, "t", "m0", "k0")
        for f in (f1, f2):
            f.signal(signal.SIGSTOP)
        await leader_of([old], isr=1)  # the followers left the ISR: nothing more reaches them
        async with PullConsumer(old.address, "g") as c:
            with pytest.raises(OnceqError) as err:
                await c.commit_offset("t", 0, 1)  # only in the old leader's log
        assert err.value.code == ErrorCode.NOT_ENOUGH_REPLICAS
        old.kill()
        for f in (f1, f2):
            f.signal(signal.SIGCONT)
        new = await leader_of([f1, f2], timeout=15)
        await send(new.address, "t", "m1", "k1", retries=5)
        old.start()

        async def equal() -> bool:
            st = await status(new)
            if st is None or len(st["isr"]) != 3:
                return False
            logs = [n.log_bytes() for n in group]
            return logs[0] == logs[1] == logs[2]

        await wait_until(equal, 15, "the returning broker in sync with an equal log")
        assert await pull_all(new.address, "t") == [b"m0", b"m1"]
        async with PullConsumer(new.address, "g") as c:
            assert await c.fetch_offset("t", 0) is None
        assert "cutting the divergent tail" in old.tail()

    asyncio.run(go())
