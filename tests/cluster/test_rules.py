"""The coordination layer's pure parts, without etcd: lease timing on a fake clock, the
role decision, the key layout and the encodings."""

from __future__ import annotations

import asyncio

import pytest

from onceq.cluster import (
    EtcdUnavailable,
    LeaderRecord,
    LeaseClock,
    Role,
    Session,
    decide,
    default_margin,
    is_stale,
    parse_endpoints,
)
from onceq.cluster._etcd import Compare, KeyValue, prefix_end
from onceq.cluster._keys import (
    IsrRecord,
    Member,
    broker_key,
    brokers_prefix,
    decode_epoch,
    encode_epoch,
    epoch_key,
    leader_key,
)
from onceq.cluster._role import Leadership, keepalive_interval, may_campaign, next_epoch
from tests.clock import FakeClock


def test_a_lease_is_counted_on_until_the_send_time_plus_ttl_minus_the_margin():
    clock = FakeClock()
    lease = LeaseClock(margin=0.4)
    assert not lease.valid(clock())  # never granted
    sent = clock()
    clock.advance(0.3)  # the answer took 0.3 s: the lease still counts from the send
    lease.renewed(sent, ttl=2)
    assert lease.valid_until == pytest.approx(sent + 1.6)
    clock.advance(1.29)
    assert lease.valid(clock()) and lease.remaining(clock()) == pytest.approx(0.01)
    clock.advance(0.02)
    assert not lease.valid(clock()) and lease.remaining(clock()) == 0
    assert not lease.check(clock()) and lease.lost


def test_renewals_extend_the_lease_and_an_old_answer_never_shortens_it():
    clock = FakeClock()
    lease = LeaseClock(margin=0.5)
    lease.renewed(clock(), 3)
    first = lease.valid_until
    lease.renewed(clock() - 1, 3)  # an answer to an older renewal arrives late
    assert lease.valid_until == first
    clock.advance(1)
    lease.renewed(clock(), 3)
    assert lease.valid_until == first + 1


def test_a_lost_lease_stays_lost_even_when_a_late_renewal_answers():
    clock = FakeClock()
    lease = LeaseClock(margin=0.25)
    lease.renewed(clock(), 1)
    clock.advance(0.8)
    assert not lease.check(clock())
    lease.renewed(clock(), 1)
    assert not lease.valid(clock())
    fresh = LeaseClock(margin=0.25)
    fresh.renewed(clock(), 0)  # etcd: the lease is gone
    assert fresh.lost and not fresh.valid(clock())


def test_the_margin_and_the_keepalive_rhythm():
    assert default_margin(10) == 2 and default_margin(2) == pytest.approx(0.4)
    assert default_margin(1) == 0.25
    # two renewals in a row may fail before the holder stops counting on its lease
    for ttl in (1, 2, 10, 30):
        assert 2 * keepalive_interval(ttl) < ttl - default_margin(ttl)
    with pytest.raises(ValueError):
        LeaseClock(margin=-1)


def _record(lease: int, epoch: int = 3) -> LeaderRecord:
    return LeaderRecord("b1", epoch, "h:1", lease, revision=40)


def test_the_role_follows_from_the_observed_leader_key_and_the_own_lease():
    assert decide(None, own_lease=7, lease_valid=True) is Role.CANDIDATE
    assert decide(_record(7), own_lease=7, lease_valid=True) is Role.LEADER
    assert decide(_record(8), own_lease=7, lease_valid=True) is Role.FOLLOWER
    # without a valid lease: never leader, even if the key still shows our lease
    for observed in (None, _record(7), _record(8)):
        assert decide(observed, own_lease=7, lease_valid=False) is Role.INACTIVE


def test_epochs_rise_by_one_and_older_epochs_are_stale():
    assert next_epoch(0) == 1 and next_epoch(41) == 42
    assert is_stale(3, current_epoch=4) and not is_stale(4, 4) and not is_stale(5, 4)
    token = Leadership.of(_record(7, epoch=5))
    assert (token.epoch, token.lease_id, token.revision) == (5, 7, 40)


def test_key_layout_and_names():
    assert broker_key("prod", "g1", "b-2") == b"/onceq/prod/brokers/g1/b-2"
    assert brokers_prefix("prod", "g1") == b"/onceq/prod/brokers/g1/"
    assert leader_key("prod", "g1") == b"/onceq/prod/groups/g1/leader"
    assert epoch_key("prod", "g1") == b"/onceq/prod/groups/g1/epoch"
    for bad in ("", "a/b", "x" * 129, "sp ace"):
        with pytest.raises(ValueError, match="invalid"):
            broker_key("prod", "g1", bad)


def _kv(value: bytes, lease: int = 0) -> KeyValue:
    return KeyValue(b"k", value, create_revision=5, mod_revision=6, version=1, lease=lease)


def test_values_round_trip_as_json():
    member = Member("b1", "10.0.0.1:9876", {"zone": "a"})
    assert Member.from_kv(_kv(member.encode(), lease=9)) == Member("b1", "10.0.0.1:9876",
                                                                   {"zone": "a"}, 9)
    raw = LeaderRecord.encode("b1", 4, "h:1")
    assert raw == b'{"address":"h:1","broker_id":"b1","epoch":4}'
    assert LeaderRecord.from_kv(_kv(raw, lease=9)) == LeaderRecord("b1", 4, "h:1", 9, 5)
    assert decode_epoch(None) == 0 and decode_epoch(_kv(encode_epoch(12))) == 12
    with pytest.raises(ValueError):
        decode_epoch(_kv(b'"x"'))
    with pytest.raises(ValueError, match="not JSON"):
        Member.from_kv(_kv(b"\x80"))


def test_endpoints_compares_and_prefixes():
    assert parse_endpoints("etcd://a:1,b:2") == [("a", 1), ("b", 2)]
    assert parse_endpoints(["http://h", "[::1]:2390"]) == [("h", 2379), ("::1", 2390)]
    with pytest.raises(ValueError):
        parse_endpoints(" , ")
    assert prefix_end(b"/onceq/") == b"/onceq0" and prefix_end(b"a\xff") == b"b"
    assert Compare(b"k", "CREATE", "EQUAL", 0).to_json() == {
        "key": "aw==", "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


class _SilentEtcd:
    """Grants leases, then never answers a renewal (as behind a partition)."""

    async def lease_grant(self, ttl: int) -> tuple[int, int]:
        return 77, ttl

    async def lease_keepalive(self, lease: int, timeout: float | None = None) -> int:
        await asyncio.sleep(timeout or 0)
        raise EtcdUnavailable("/v3/lease/keepalive", [("127.0.0.1:1", "timed out")])


async def test_a_session_without_renewals_is_lost_at_ttl_minus_margin():
    loop = asyncio.get_running_loop()
    reasons = []
    session = Session(_SilentEtcd(), ttl=1, on_lost=reasons.append)  # type: ignore[arg-type]
    start = loop.time()
    await session.start()
    assert session.valid()
    await asyncio.wait_for(session.lost.wait(), 2)
    elapsed = loop.time() - start
    assert 0.7 <= elapsed < 1.0  # at 1 s - 0.25 s, before etcd could expire it
    assert not session.valid() and reasons and "no renewal" in reasons[0]
    await session.close()


def test_only_the_published_isr_may_run_unless_unclean():
    isr = IsrRecord(4, "1", ("1", "3"))
    assert may_campaign(None, "2")  # nothing published: a new group, anyone
    assert may_campaign(isr, "3") and not may_campaign(isr, "2")
    assert may_campaign(isr, "2", clean=False)
    kv = KeyValue(b"/onceq/c/groups/g/isr", isr.encode(), 1, 2, 1, 0)
    assert IsrRecord.from_kv(kv) == isr
    assert IsrRecord.from_kv(None) is None
