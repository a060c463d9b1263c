"""ConnectionGuard: the connection cap and its rate-limited log, the sweep interval."""

from __future__ import annotations

import logging

from onceq.broker.limits import ConnectionGuard, fd_limit, open_fds, sweep_interval


def test_sweep_interval():
    assert sweep_interval(30, 300) == 1.0
    assert sweep_interval(0.5, 1.0) == 0.125
    assert sweep_interval(0, 0) == 1.0  # both off: the sweep still sends waiting pushes
    assert sweep_interval(0.01, 0) == 0.02


def test_capacity_from_the_fd_limit_and_max_connections():
    g = ConnectionGuard(0, 128, 30, 300)
    g.fd_limit, g.own_fds = 1024, 40
    assert g.capacity() == 1024 - 128 - 40
    g.max_connections = 100
    assert g.capacity() == 100
    g.max_connections = 5000
    assert g.capacity() == 1024 - 128 - 40
    g.own_fds = 2000  # the store holds more than the limit allows: refuse everything
    assert g.capacity() == 0


def test_measure_counts_what_is_not_a_connection():
    g = ConnectionGuard(0, 128, 30, 300)
    n = open_fds()
    assert n is not None and n > 0 and fd_limit() >= n
    g.measure(0)
    assert g.own_fds >= n - 2
    g.measure(3)
    assert g.own_fds >= n - 5


def test_measure_sets_aside_what_the_store_may_still_open():
    g = ConnectionGuard(0, 128, 30, 300, headroom=lambda: 250)
    g.measure(0)
    n = open_fds()
    assert n is not None and g.own_fds >= 250 + n - 2


def test_refusals_are_logged_at_most_once_per_period(caplog):
    now = [100.0]
    g = ConnectionGuard(2, 16, 30, 300, clock=lambda: now[0])
    g.fd_limit, g.own_fds = 1000, 0
    g.measure = lambda connections: None  # type: ignore[method-assign]
    assert g.admit(0, "p") and g.admit(1, "p")
    with caplog.at_level(logging.WARNING, logger="onceq.broker"):
        for _ in range(50):
            assert not g.admit(2, "peer:1")
        now[0] += 9.9
        assert not g.admit(2, "peer:2")
        now[0] += 0.2
        assert not g.admit(2, "peer:3")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("refused 1 connection(s)")
    assert lines[1].startswith("refused 51 connection(s) (latest from peer:3)")
    assert g.refused == 52
