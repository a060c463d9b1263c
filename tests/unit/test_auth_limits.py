"""Failed-login limits: lockout with backoff, per source and per user, bounded memory."""

from __future__ import annotations

import logging

import pytest

from onceq.broker.auth_limits import FailedLogins
from tests.clock import FakeClock


@pytest.fixture
def clock():
    return FakeClock()


def limits(clock, **kw) -> FailedLogins:
    return FailedLogins(clock, max_failures=5, window_s=60, lockout_s=30,
                        max_lockout_s=600, **kw)


def fail(lim: FailedLogins, n: int, source="10.0.0.1", user="alice") -> list[float | None]:
    return [lim.failed(source, user) for _ in range(n)]


def test_lockout_after_max_failures(clock, caplog):
    lim = limits(clock)
    assert fail(lim, 4) == [None] * 4
    assert lim.check("10.0.0.1", "alice") is None
    with caplog.at_level(logging.WARNING, logger="onceq.auth"):
        assert lim.failed("10.0.0.1", "alice") == 30
    assert "login lockout: source 10.0.0.1" in caplog.text and "'alice'" in caplog.text
    assert lim.check("10.0.0.1", "alice") == 30
    assert lim.check("10.0.0.1", "bob") == 30  # the source is locked, whatever the user
    assert lim.check("10.0.0.2", "bob") is None
    assert lim.check("10.0.0.2", "alice") is None  # one source does not lock the user
    clock.advance(29.5)
    assert lim.check("10.0.0.1", "alice") == pytest.approx(0.5)
    clock.advance(0.5)
    assert lim.check("10.0.0.1", "alice") is None


def test_failures_outside_the_window_do_not_count(clock):
    lim = limits(clock)
    for _ in range(10):
        fail(lim, 4)
        clock.advance(61)
    assert lim.check("10.0.0.1", "alice") is None


def test_lockout_doubles_up_to_the_cap_and_resets_after_quiet(clock):
    lim = limits(clock)
    seen = []
    for _ in range(7):
        seen.append(fail(lim, 5)[-1])
        clock.advance(seen[-1])
    assert seen == [30, 60, 120, 240, 480, 600, 600]
    clock.advance(601)  # quiet for longer than the cap: back to the first step
    assert fail(lim, 5)[-1] == 30


def test_success_forgets_only_that_users_failures(clock):
    lim = limits(clock)
    fail(lim, 4, user="alice")
    lim.succeeded("10.0.0.1", "alice")  # a mistyped password, then the right one
    assert fail(lim, 4, user="alice") == [None] * 4
    lim.succeeded("10.0.0.1", "alice")
    fail(lim, 4, user="bob")
    lim.succeeded("10.0.0.1", "mallory")  # a success as another user clears nothing
    assert lim.failed("10.0.0.1", "bob") == 30


def test_success_does_not_lift_a_lockout(clock):
    lim = limits(clock)
    fail(lim, 5)
    lim.succeeded("10.0.0.1", "alice")
    assert lim.check("10.0.0.1", "alice") == 30


def test_a_user_guessed_from_many_sources_is_locked(clock, caplog):
    lim = limits(clock, max_user_failures=8)
    with caplog.at_level(logging.WARNING, logger="onceq.auth"):
        for i in range(8):
            lim.failed(f"10.0.1.{i}", "alice")
    assert "login lockout: user 'alice'" in caplog.text
    assert lim.check("10.9.9.9", "alice") == 30
    assert lim.check("10.9.9.9", "bob") is None
    assert lim.check("10.9.9.9", None) is None


def test_ipv6_sources_count_per_64(clock):
    lim = limits(clock)
    for i in range(5):
        lim.failed(f"2001:db8:1:2::{i + 1}", "alice")
    assert lim.check("2001:db8:1:2:ffff::9", "bob") == 30
    assert lim.check("[2001:db8:1:2::77]", "bob") == 30
    assert lim.check("2001:db8:1:3::1", "bob") is None
    fail(lim, 5, source="::ffff:192.0.2.7")
    assert lim.check("192.0.2.7", "bob") == 30  # an IPv4-mapped address is the IPv4 one
    assert lim.source_key("not-an-address") == "not-an-address"


def test_memory_is_bounded(clock):
    lim = limits(clock, max_tracked=100)
    for i in range(1000):
        lim.failed(f"10.1.{i // 256}.{i % 256}", f"user{i}")
    assert lim.tracked() == (100, 100)
    # the most recent entries are the ones kept
    fail(lim, 4, source="10.1.3.231", user="x")  # i=999 had one failure already
    assert lim.check("10.1.3.231", None) == 30


def test_bad_parameters_are_refused(clock):
    for kw in ({"max_failures": 0}, {"window_s": 0}, {"lockout_s": 0},
               {"lockout_s": 10, "max_lockout_s": 5}, {"max_tracked": 0},
               {"ipv6_prefix": 129}):
        with pytest.raises(ValueError):
            FailedLogins(clock, **kw)


def test_endless_failures_from_one_source_never_overflow_the_lockout(clock):
    """Failures go on being counted during lockouts (a flood of malformed exchanges): the
    lockout doubles up to its longest and stays there, whatever their number."""
    lim = FailedLogins(clock)  # the broker's defaults: 5 failures, 30 s doubling to 1 h
    results = fail(lim, 20_000)
    locks = [r for r in results if r is not None]
    assert len(locks) == 20_000 // 5 and max(locks) == 3600
    assert locks[:9] == [30, 60, 120, 240, 480, 960, 1920, 3600, 3600]
