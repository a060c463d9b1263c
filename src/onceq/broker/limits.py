"""Per-connection limits: the connection cap, the input budget and one periodic sweep.

* **Connection cap**: a new connection is refused (one ``TOO_MANY_CONNECTIONS`` error frame,
  then close) when ``max_connections`` connections are open, or when accepting it would leave
  fewer than ``fd_reserve`` file descriptors free below the process limit
  (``RLIMIT_NOFILE``). The descriptors the broker holds for itself (commit-log segments,
  index files, its listening socket...) are counted from ``/proc/self/fd`` at start and on
  every sweep, and the index-file cache's whole capacity is set aside, so the store's
  files never starve, however many clients try to connect.
* **Read timeout**: a frame started but not completed within ``read_timeout_s`` closes the
  connection (slow senders, partial frames trickled byte by byte).
* **Idle timeout**: a connection that sends nothing for ``idle_timeout_s`` is closed, unless
  it waits for a held long-poll pull or its answers are being read (resumed writing).
* **Input budget**: the partial frames of all connections together are bounded by
  ``max_input``, shared fairly: while the total is above it, a connection that holds more
  than its fair share (``max_input`` over the connections with a partial frame) is not read
  until the total is below again (``unblock``, on every sweep and whenever a connection
  ends); one within its share goes on, so slow senders that filled the budget do not stall
  a producer's large message. Above twice the budget every connection that reads waits.
* A connection the broker closed whose client does not read the last answers is aborted
  after ``CLOSE_GRACE_S``.

One sweep every ``interval`` seconds checks every connection and sends the pushes that
waited; connections only count their activity (a few integer operations per read), so the
request path stays cheap. The output limit is enforced by the connection itself
(``Connection._check_output``), when its writes pass the high-water mark.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger("onceq.broker")

REFUSAL_LOG_EVERY_S = 10.0  # at most one log line about refused connections per period
CLOSE_GRACE_S = 10.0  # a closed connection whose client does not read its last answers
_FD_DIRS = ("/proc/self/fd", "/dev/fd")


def fd_limit() -> int:
    """The process's soft limit of open file descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = hard if hard != resource.RLIM_INFINITY else 1 << 20
    return soft


def open_fds() -> int | None:
    """How many file descriptors the process has open (None when it cannot tell)."""
    for d in _FD_DIRS:
        try:
            return len(os.listdir(d)) - 1  # minus the one listdir itself used
        except OSError:
            continue
    return None


def sweep_interval(read_timeout_s: float, idle_timeout_s: float) -> float:
    """Check often enough that a timeout fires at most a quarter late (at most 1 s)."""
    timeouts = [t for t in (read_timeout_s, idle_timeout_s) if t > 0]
    return max(0.02, min([1.0] + [t / 4 for t in timeouts]))


class ConnectionGuard:
    def __init__(self, max_connections: int, fd_reserve: int, read_timeout_s: float,
                 idle_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 max_input: int = 1 << 62, headroom: Callable[[], int] = lambda: 0,
                 max_output: int = 1 << 62) -> None:
        self.max_connections = max_connections  # 0: only the file-descriptor bound
        self.fd_reserve = fd_reserve
        self.read_timeout_s = read_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self.interval = sweep_interval(read_timeout_s, idle_timeout_s)
        self.fd_limit = fd_limit()
        self.own_fds = 0  # descriptors not held by client connections (store, sockets...)
        # descriptors the store may still open on its own (its index-file cache not full yet)
        self.headroom = headroom
        self.refused = 0  # refused connections, total
        # partial frames of all connections: above max_input, connections adding to it
        # are not read until the total is below again (checked on every sweep)
        self.max_input = max_input
        self.input_buffered = 0
        self.partial = 0  # connections with a partial frame
        self.blocked: set[Connection] = set()
        # output queued for clients that do not read (write-paused): above max_output in
        # all, the client with the most is dropped first, until the total is below again
        self.max_output = max_output
        self.write_paused: set[Connection] = set()
        self.output_dropped = 0  # clients dropped for the output budget, total
        self._refused_unlogged = 0
        self._refusal_logged_at = -REFUSAL_LOG_EVERY_S

    # ------------------------------------------------------------------ output budget
    def check_output(self) -> None:
        """Drop the clients holding the most unread output until all of them together
        hold at most ``max_output`` bytes (each one is also bound by its own limit)."""
        pending = {c: c.pending_output() for c in self.write_paused if not c.closed}
        total = sum(pending.values())
        for c in sorted(pending, key=pending.__getitem__, reverse=True):
            if total <= self.max_output:
                break
            total -= pending[c]
            self.output_dropped += 1
            c.abort(f"output budget: {pending[c]} bytes of output queued for this client, "
                    f"{total + pending[c]} for all clients that do not read, above the "
                    f"budget of {self.max_output} bytes")

    # ------------------------------------------------------------------ connection cap
    def measure(self, connections: int) -> None:
        """Count the descriptors the broker holds or may open itself, besides its client
        connections: those open now and what its index-file cache may still open."""
        n = open_fds()
        if n is not None:
            self.own_fds = max(0, n - connections) + max(0, self.headroom())

    def capacity(self) -> int:
        """How many client connections may be open now."""
        by_fds = self.fd_limit - self.fd_reserve - self.own_fds
        if self.max_connections:
            return max(0, min(self.max_connections, by_fds))
        return max(0, by_fds)

    def admit(self, open_connections: int, peer: str) -> bool:
        """True when one more connection may open; else count and (rate-limited) log it."""
        cap = self.capacity()
        if open_connections < cap:
            return True
        self.refused += 1
        self._refused_unlogged += 1
        now = self.clock()
        if now - self._refusal_logged_at >= REFUSAL_LOG_EVERY_S:
            log.warning("refused %d connection(s) (latest from %s): %d connections open, "
                        "limit %d (max_connections %s, fd limit %d, fd reserve %d, %d fds "
                        "held by the broker)", self._refused_unlogged, peer, open_connections,
                        cap, self.max_connections or "auto", self.fd_limit, self.fd_reserve,
                        self.own_fds)
            self._refusal_logged_at = now
            self._refused_unlogged = 0
        return False

    # ------------------------------------------------------------------ input budget
    def input_changed(self, before: int, after: int) -> bool:
        """A connection's partial frame went from ``before`` to ``after`` bytes: whether it
        must stop reading (it holds more than its fair share of a full budget)."""
        self.input_buffered += after - before
        self.partial += (after > 0) - (before > 0)
        total, budget = self.input_buffered, self.max_input
        if after <= before or total <= budget:
            return False
        return total > 2 * budget or after > budget // max(self.partial, 1)

    def unblock(self) -> None:
        """Read the blocked connections again once partial frames fit the budget."""
        if self.blocked and self.input_buffered <= self.max_input:
            blocked, self.blocked = self.blocked, set()
            for conn in blocked:
                conn.unblock_input()

    # ------------------------------------------------------------------ the sweep
    def sweep(self, connections: Iterable[Connection]) -> None:
        """Close connections past their read or idle timeout; flush waiting pushes."""
        conns = list(connections)
        self.measure(len(conns))
        now = self.clock()
        self.unblock()
        read_to, idle_to = self.read_timeout_s, self.idle_timeout_s
        for conn in conns:
            if conn.closed:
                # closed by the broker (protocol error, shutdown) but the client does not
                # read the last answers: the transport would wait for it forever
                if (conn.closed_at is not None and now - conn.closed_at >= CLOSE_GRACE_S
                        and conn.transport is not None):
                    log.info("closing connection %s: its last answers were not read within "
                             "%gs", conn.peer, CLOSE_GRACE_S)
                    conn.transport.abort()
                    conn.closed_at = None
                continue
            conn.send_pushes(force=True)  # pushes held back while output was unsent
            # read timeout: a frame started (bytes buffered) and not completed since; not
            # while the client does not read our answers (we do not read it then), but
            # while the input budget is full (else stalled senders would keep it full)
            if read_to > 0 and conn.decoder.buffered and not conn.write_paused:
                if conn.partial_at is None or conn.partial_mark != conn.frames_in:
                    conn.partial_at, conn.partial_mark = now, conn.frames_in
                elif now - conn.partial_at >= read_to:
                    conn.abort(f"read timeout: a frame started {now - conn.partial_at:.1f}s "
                               f"ago is still incomplete ({conn.decoder.buffered} bytes "
                               f"received, limit {read_to:g}s)", logging.WARNING)
                    continue
            else:
                conn.partial_at = None
            # idle timeout: nothing received and nothing of ours read since active_at
            if idle_to > 0:
                if conn.active_mark != conn.activity:
                    conn.active_mark, conn.active_at = conn.activity, now
                elif conn.held_pulls:  # waiting for a held long-poll pull is not idleness
                    conn.active_at = now
                elif now - conn.active_at >= idle_to:
                    conn.abort(f"idle for {now - conn.active_at:.1f}s (limit {idle_to:g}s)",
                               logging.INFO)
