"""Leader election with epochs against a real etcd (see conftest.py): one leader at a
time, a higher epoch after every failover, and a leader that loses its lease steps down
before anyone else is elected."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from onceq.cluster import (
    Election,
    EtcdClient,
    Leadership,
    Role,
    Session,
    current_leader,
    epoch_key,
)
from onceq.cluster._etcd import KeyValue
from tests.cluster.partition import PartitionProxy

ROOT = Path(__file__).resolve().parents[2]
TTL = 2  # seconds; margin 0.4 s


class Candidate:
    """A session and an election, with what happened to them, timed."""

    def __init__(self, client: EtcdClient, cluster: str, broker_id: str, group: str = "g1",
                 ttl: float = TTL) -> None:
        self.client, self.cluster, self.broker_id, self.group = client, cluster, broker_id, group
        self.ttl = ttl
        self.elected_at: list[tuple[float, Leadership]] = []
        self.stepped_down_at: list[tuple[float, str]] = []
        self.hooks: list[Callable[[Leadership], None]] = []

    async def start(self) -> Candidate:
        self.session = await Session(self.client, ttl=self.ttl).start()
        self.election = Election(self.session, self.cluster, self.group, self.broker_id,
                                 f"addr-{self.broker_id}", on_elected=self._elected,
                                 on_step_down=self._stepped_down)
        self.election.start()
        return self

    def _elected(self, term: Leadership) -> None:
        self.elected_at.append((time.monotonic(), term))
        for hook in self.hooks:
            hook(term)

    def _stepped_down(self, term: Leadership, reason: str) -> None:
        self.stepped_down_at.append((time.monotonic(), reason))

    async def close(self) -> None:
        await self.election.close()
        await self.session.close()


async def until(predicate: Callable[[], bool], timeout: float) -> None:
    """Wait until ``predicate()`` holds (checked every 10 ms), failing after ``timeout``."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def leaders(candidates: list[Candidate]) -> list[Candidate]:
    return [c for c in candidates if c.election.is_leader()]


async def test_a_single_candidate_wins_with_epoch_1(etcd_endpoint, cluster_name):
    client = EtcdClient(etcd_endpoint)
    a = await Candidate(client, cluster_name, "b1").start()
    await asyncio.wait_for(a.election.elected.wait(), 3)
    term = a.election.leadership
    assert term is not None and (term.broker_id, term.epoch) == ("b1", 1)
    assert term.lease_id == a.session.lease_id and a.election.role is Role.LEADER
    record, epoch = await current_leader(client, cluster_name, "g1")
    assert (record.broker_id, record.epoch, record.address, record.revision) == (
        "b1", 1, "addr-b1", term.revision)
    assert epoch == 1
    await a.close()
    assert await current_leader(client, cluster_name, "g1") == (None, 1)


async def test_three_candidates_elect_exactly_one_leader(etcd_endpoint, cluster_name):
    client = EtcdClient(etcd_endpoint)
    group = [Candidate(client, cluster_name, f"b{i}") for i in range(3)]
    await asyncio.gather(*(c.start() for c in group))
    await until(lambda: len(leaders(group)) == 1
                and all(c.election.leader is not None for c in group), 5)
    (leader,) = leaders(group)
    assert leader.election.leadership.epoch == 1
    assert {c.election.leader for c in group} == {leader.election.leader}
    assert sorted(c.election.role.value for c in group) == ["follower", "follower", "leader"]
    assert sum(len(c.elected_at) for c in group) == 1
    follower = next(c for c in group if c is not leader)
    await follower.election.resign()  # a follower's resign leaves the leader key alone
    record, _ = await current_leader(client, cluster_name, "g1")
    assert record == leader.election.leader and leader.election.is_leader()
    await asyncio.gather(*(c.close() for c in group))


async def test_a_killed_leader_process_is_replaced_with_a_higher_epoch(etcd_endpoint,
                                                                      cluster_name):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.cluster.candidate_proc", etcd_endpoint, cluster_name,
        "g1", "b0", str(TTL), cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 10)
        assert line == b"leader 1\n"
        client = EtcdClient(etcd_endpoint)
        followers = [await Candidate(client, cluster_name, f"b{i}").start() for i in (1, 2)]
        await until(lambda: all(c.election.leader is not None for c in followers), 3)
        assert leaders(followers) == []
        killed = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        await until(lambda: len(leaders(followers)) == 1, TTL + 3)
        (leader,) = leaders(followers)
        took = leader.elected_at[0][0] - killed
        assert took < TTL + 1.0, took  # the TTL, plus etcd's 0.5 s expiry check
        assert leader.election.leadership.epoch == 2
        await until(lambda: all(c.election.leader.epoch == 2 for c in followers), 2)
        await asyncio.gather(*(c.close() for c in followers))
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_a_leader_whose_lease_is_revoked_steps_down_and_another_takes_over(
        etcd_endpoint, cluster_name):
    client = EtcdClient(etcd_endpoint)
    a = await Candidate(client, cluster_name, "b1").start()
    await asyncio.wait_for(a.election.elected.wait(), 3)
    b = await Candidate(client, cluster_name, "b2").start()
    await until(lambda: b.election.leader is not None, 3)
    await client.lease_revoke(a.session.lease_id)
    await asyncio.wait_for(b.election.elected.wait(), 3)
    assert b.election.leadership.epoch == 2
    await until(lambda: bool(a.stepped_down_at), 3)
    assert not a.election.is_leader()
    await asyncio.gather(a.close(), b.close())


async def test_a_partitioned_leader_steps_down_before_the_new_leader_is_elected(
        etcd_endpoint, cluster_name):
    host, port = etcd_endpoint.split(":")
    proxy = await PartitionProxy(host, int(port)).start()
    try:
        a = await Candidate(EtcdClient(proxy.endpoint, timeout=1), cluster_name, "b1").start()
        await asyncio.wait_for(a.election.elected.wait(), 3)
        b = await Candidate(EtcdClient(etcd_endpoint), cluster_name, "b2").start()
        await until(lambda: b.election.leader is not None, 3)
        old_leader_believed = []
        b.hooks.append(lambda term: old_leader_believed.append(a.election.is_leader()))

        cut = time.monotonic()
        proxy.partition()  # a's renewals no longer reach etcd
        await asyncio.wait_for(b.election.elected.wait(), TTL + 3)
        (down_at, reason), = a.stepped_down_at
        up_at, term = b.elected_at[0]
        assert "no renewal" in reason
        assert down_at < up_at and old_leader_believed == [False]
        # a counted on its lease until at most ttl - margin after its last renewal
        assert down_at - cut < TTL - a.session.margin + 0.3
        assert term.epoch == 2 and term.epoch > a.elected_at[0][1].epoch

        proxy.heal()  # a's session is lost for good: it neither leads nor campaigns
        await asyncio.wait_for(a.election.stopped.wait(), 3)
        assert a.election.role is Role.INACTIVE and not a.election.is_leader()
        record, epoch = await current_leader(b.client, cluster_name, "g1")
        assert (record.broker_id, epoch) == ("b2", 2)
        await asyncio.gather(a.close(), b.close())
    finally:
        await proxy.close()


async def test_resign_hands_over_at_once_and_epochs_only_rise(etcd_endpoint, cluster_name):
    client = EtcdClient(etcd_endpoint)
    group = [await Candidate(client, cluster_name, f"b{i}").start() for i in range(3)]
    epochs = []
    for _ in range(3):
        await until(lambda: len(leaders(group)) == 1, 3)
        (leader,) = leaders(group)
        epochs.append(leader.election.leadership.epoch)
        resigned = time.monotonic()
        await leader.election.resign()
        assert leader.stepped_down_at[-1][1] == "resigned"
        assert not leader.election.is_leader() and leader.election.role is Role.INACTIVE
        record, _ = await current_leader(client, cluster_name, "g1")
        assert record is None or record.broker_id != leader.broker_id  # deleted, lease alive
        assert leader.session.valid()
        group.remove(leader)
        if group:
            await until(lambda: len(leaders(group)) == 1, 1.0)  # no wait for a lease
            assert max(t for c in group for t, _ in c.elected_at) - resigned < 1.0
        await leader.session.close()
    assert epochs == [1, 2, 3]
    assert await current_leader(client, cluster_name, "g1") == (None, 3)


class _PausingClient(EtcdClient):
    """Pauses after its first read of the epoch key until the test lets it go on."""

    def __init__(self, endpoint: str, watched: bytes) -> None:
        super().__init__(endpoint)
        self.watched = watched
        self.paused = asyncio.Event()
        self.go_on = asyncio.Event()

    async def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        answer = await super().get(key)
        if key == self.watched and not self.paused.is_set():
            self.paused.set()
            await self.go_on.wait()
        return answer


async def test_a_candidate_that_read_a_stale_epoch_cannot_claim_it(etcd_endpoint,
                                                                   cluster_name):
    slow_client = _PausingClient(etcd_endpoint, epoch_key(cluster_name, "g1"))
    slow = await Candidate(slow_client, cluster_name, "slow").start()
    await asyncio.wait_for(slow_client.paused.wait(), 3)  # it read epoch 0, not yet claimed
    fast = await Candidate(EtcdClient(etcd_endpoint), cluster_name, "fast").start()
    await asyncio.wait_for(fast.election.elected.wait(), 3)
    await fast.election.resign()  # epoch 1 came and went
    slow_client.go_on.set()
    await asyncio.wait_for(slow.election.elected.wait(), 3)
    assert slow.election.leadership.epoch == 2  # not a second epoch 1
    await asyncio.gather(slow.close(), fast.close())
