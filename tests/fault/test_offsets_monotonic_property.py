"""Property: a group's committed offsets never move back except by an explicit reset.

Random sequences of requests against the real broker (its dispatch and services, a fake
clock, no sockets): heartbeats with any ``held`` lists, pulls with and without a carried
commit, commits of any offset from members, former members and clients without an id,
releases, disconnects, heartbeat expiries, forced resets and broker restarts. After every
step each queue's stored offset is at least what it was, unless that step was a reset.
"""

from __future__ import annotations

import asyncio
import itertools
import tempfile

import msgpack
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from onceq.broker.broker import Broker
from onceq.broker.config import BrokerConfig
from onceq.log.record import encode_part
from onceq.protocol.codes import RequestCode
from onceq.protocol.frame import REQUEST
from tests.clock import FakeClock
from tests.helpers import small_store

TOPIC, GROUP, QUEUES, MESSAGES = "mono", "mono-g", 2, 40
MEMBERS = ["a", "b", "c"]
_corr = itertools.count(1)


class _Conn:
    """What the broker's handlers use of a connection: answers and pushes are recorded."""

    def __init__(self, name: str) -> None:
        self.peer = name
        self.client_ids: set[str] = set()
        self.writer_ids: set[str] = set()
        self.closed = False
        self.held_pulls = 0
        self.answers: dict[int, tuple[int, dict]] = {}

    def respond(self, corr: int, code: int, header: dict, payload: bytes = b"") -> None:
        self.answers[corr] = (code, header)

    def answer(self, corr: int, reply) -> None:
        self.respond(corr, 0, reply.encode())

    def push(self, message) -> None:
        pass


def _request(broker: Broker, conn: _Conn, code: RequestCode, header: dict) -> tuple[int, dict]:
    corr = next(_corr)
    broker.dispatch(conn, REQUEST, int(code), corr, msgpack.packb(header, use_bin_type=True),
                    b"")
    return conn.answers.get(corr, (0, {}))


queue = st.integers(0, QUEUES - 1)
offset = st.integers(0, MESSAGES + 5)
member = st.sampled_from(MEMBERS)
step = st.one_of(
    st.tuples(st.just("heartbeat"), member,
              st.lists(st.tuples(queue, offset), max_size=QUEUES, unique_by=lambda x: x[0])),
    st.tuples(st.just("pull"), member, queue, offset, st.none() | offset),
    st.tuples(st.just("commit"), st.sampled_from([*MEMBERS, None]), queue, offset),
    st.tuples(st.just("release"), member, queue, st.integers(-1, MESSAGES + 5)),
    st.tuples(st.just("wait"), st.sampled_from([1.0, 5.0, 31.0, 121.0])),
    st.tuples(st.just("disconnect"), member),
    st.tuples(st.just("reset"), queue, offset),
    st.tuples(st.just("restart")),
)


async def _run(steps: list[tuple]) -> None:
    clock = FakeClock()
    with tempfile.TemporaryDirectory() as data:
        def new_broker() -> Broker:
            return Broker(BrokerConfig(small_store(data), port=0, host="127.0.0.1"),
                          clock=clock)
        broker = new_broker()
        await broker.start()
        conns = {m: _Conn(m) for m in MEMBERS}
        try:
            admin = _Conn("admin")
            broker.store.create_topic(TOPIC, QUEUES)
            for q in range(QUEUES):
                broker.store.put(TOPIC, q, [encode_part(b"m", f"{q}-{i}", 1)
                                            for i in range(MESSAGES)])
            before = [broker.store.get_offset(GROUP, TOPIC, q) for q in range(QUEUES)]
            for s in steps:
                reset = None
                kind = s[0]
                if kind == "heartbeat":
                    _, m, held = s
                    _request(broker, conns[m], RequestCode.HEARTBEAT, {"client": m, "groups": [
                        {"group": GROUP, "model": "CLUSTERING", "subs": {TOPIC: "*"},
                         "held": [[TOPIC, q, o] for q, o in held]}]})
                elif kind == "pull":
                    _, m, q, o, commit = s
                    h = {"topic": TOPIC, "queue": q, "offset": o, "group": GROUP,
                         "client": m, "max": 8}
                    if commit is not None:
                        h["commit"] = commit
                    _request(broker, conns[m], RequestCode.PULL, h)
                elif kind == "commit":
                    _, m, q, o = s
                    h = {"group": GROUP, "topic": TOPIC, "queue": q, "offset": o}
                    if m is not None:
                        h["client"] = m
                    _request(broker, conns[m] if m else admin, RequestCode.COMMIT_OFFSET, h)
                elif kind == "release":
                    _, m, q, o = s
                    _request(broker, conns[m], RequestCode.RELEASE_QUEUE, {
                        "group": GROUP, "topic": TOPIC, "queue": q, "client": m,
                        "offset": o})
                elif kind == "wait":
                    clock.advance(s[1])
                    broker._expire_members()
                elif kind == "disconnect":
                    broker.on_disconnect(conns[s[1]])
                    conns[s[1]] = _Conn(s[1])
                elif kind == "reset":
                    _, reset, o = s
                    _request(broker, admin, RequestCode.RESET_OFFSETS, {
                        "group": GROUP, "topic": TOPIC, "force": True,
                        "offsets": [[reset, o]]})
                else:  # a graceful restart: whatever was committed is saved
                    await broker.stop()
                    broker = new_broker()
                    await broker.start()
                    conns = {m: _Conn(m) for m in MEMBERS}
                after = [broker.store.get_offset(GROUP, TOPIC, q) for q in range(QUEUES)]
                if after != before:
                    event(f"{kind} moved an offset {'back' if reset is not None else 'on'}")
                for q in range(QUEUES):
                    assert q == reset or after[q] >= before[q], (s, before, after)
                before = after
        finally:
            await broker.stop()


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(step, min_size=1, max_size=30))
def test_committed_offsets_move_back_only_by_an_explicit_reset(steps):
    asyncio.run(_run(steps))
