"""Run real push consumers against an in-memory broker, in virtual time.

``VirtualTimeLoop`` is an asyncio loop whose time is a ``FakeClock``: when every task waits,
the clock jumps to the next timer, so a 10-minute scenario takes milliseconds and runs the
same way every time. ``FakeBroker`` answers the requests a push consumer makes (heartbeat,
members, topics, offsets, long-polled pulls, commits, releases, orderly queue locks) from
memory, with the broker's real queue-ownership core (``QueueOwnership``: access lock,
orderly lock, commit rule) deciding who may pull and commit a queue; ``FakeConnection``
has the interface of ``client.connection.BrokerConnection`` and is what
``PushConsumer(connect=broker.connect)`` opens.
"""

from __future__ import annotations

import asyncio
import itertools
import selectors
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from onceq.broker.ownership import QueueOwnership, Refusal
from onceq.client.connection import ConnectionLost
from onceq.log.record import build_record, encode_part
from onceq.protocol.codes import PullStatus, PushCode, RequestCode
from onceq.protocol.errors import ErrorCode, OnceqError
from tests.clock import FakeClock


# ================================================================ virtual time
class _IdleAdvancingSelector(selectors.DefaultSelector):
    """Never blocks: when nothing is ready, moves the clock to the loop's next timer."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None):  # type: ignore[override]
        ready = super().select(0)
        if not ready and timeout is not None and timeout > 0:
            # at least a microsecond: a timeout below the float resolution of the clock
            # would leave the time where it is and the waiting code spinning
            self.clock.advance(max(timeout, 1e-6))
        elif not ready and timeout is None:
            raise RuntimeError("deadlock: every task waits and no timer is scheduled")
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: FakeClock) -> None:
        super().__init__(_IdleAdvancingSelector(clock))
        self.clock = clock

    def time(self) -> float:
        return self.clock()

    def call_at(self, when, callback, *args, context=None):  # type: ignore[override]
        # asyncio runs a timer up to its clock resolution early; in virtual time that would
        # leave the clock before the deadline, and code that waits for it spinning
        return super().call_at(when, self._at, when, callback, args, context=context)

    def _at(self, when: float, callback, args) -> None:
        if when > self.clock():
            self.clock.advance(when - self.clock())
        callback(*args)


def run_virtual(main: Callable[[FakeClock], Any], start: float = 1000.0) -> Any:
    """Run ``await main(clock)`` on a fresh virtual-time loop."""
    clock = FakeClock(start)
    loop = VirtualTimeLoop(clock)
    try:
        return loop.run_until_complete(main(clock))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


# ================================================================ the fake broker
@dataclass
class _Member:
    conn: FakeConnection
    access_lock: bool
    orderly: bool = False


@dataclass
class _HeldPull:
    fut: asyncio.Future
    header: dict[str, Any]
    timer: asyncio.TimerHandle | None = None


@dataclass
class FakeBroker:
    clock: FakeClock
    access_lock: bool = True
    latency: float = 0.001  # virtual seconds each way
    notify: bool = True  # push GROUP_CHANGED to members on joins and leaves
    hold_timeout: float = 30.0
    topics: dict[str, int] = field(default_factory=dict)
    log: dict[tuple[str, int], list[bytes]] = field(default_factory=dict)
    offsets: dict[tuple[str, str, int], int] = field(default_factory=dict)
    members: dict[str, dict[str, _Member]] = field(default_factory=dict)
    black_holes: set[tuple[str, int]] = field(default_factory=set)  # pulls never answered
    requests: list[tuple[str, RequestCode, dict[str, Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.core = QueueOwnership(hold_timeout=self.hold_timeout, lock_expiry=60.0)
        self.qlocks = self.core.orderly
        self._held: dict[tuple[str, int], list[_HeldPull]] = {}

    # -------------------------------------------------------- test side
    def create_topic(self, topic: str, queues: int) -> None:
        self.topics[topic] = queues
        for q in range(queues):
            self.log.setdefault((topic, q), [])

    def put(self, topic: str, queue: int, count: int = 1) -> list[str]:
        """Append ``count`` messages; return their unique keys."""
        records = self.log[(topic, queue)]
        keys = []
        for _ in range(count):
            off = len(records)
            key = f"{topic}-{queue}-{off}"
            part = encode_part(key.encode(), key, 0)
            records.append(build_record(topic.encode(), queue, off, 0, 0, part))
            keys.append(key)
        self._wake_held((topic, queue))
        return keys

    async def connect(self, address: str, on_push: Callable[[int, dict[str, Any]], None]
                      ) -> FakeConnection:
        await asyncio.sleep(self.latency)
        return FakeConnection(self, on_push)

    def holder(self, group: str, topic: str, queue: int) -> str | None:
        return self.core.access.holder(group, topic, queue)

    def _commit_rule(self, h: dict[str, Any], offset: int, checked: bool = False
                     ) -> Refusal | None:
        """The core's commit rule; stores what it allows."""
        key = (h["group"], h["topic"], h["queue"])
        d = self.core.commit(h["group"], h.get("client"), h["topic"], h["queue"], offset,
                             locked=self._applies(h["group"], h.get("client")),
                             stored=self.offsets.get(key, -1),
                             queue_max=len(self.log[key[1:]]), now=self.clock(),
                             checked=checked)
        if d.write is not None:
            self.offsets[key] = d.write
        return d.refused

    # -------------------------------------------------------- requests
    def handle(self, conn: FakeConnection, code: RequestCode, h: dict[str, Any]
               ) -> tuple[dict[str, Any], bytes] | asyncio.Future:
        self.requests.append((h.get("client", ""), code, dict(h)))
        if code == RequestCode.HEARTBEAT:
            return self._heartbeat(conn, h), b""
        if code == RequestCode.UNREGISTER:
            self._leave(h["group"], h["client"])
            return {}, b""
        if code == RequestCode.GET_TOPIC:
            if h["topic"] not in self.topics:
                raise OnceqError(ErrorCode.TOPIC_NOT_EXIST, h["topic"])
            return {"topic": h["topic"], "queues": self.topics[h["topic"]]}, b""
        if code == RequestCode.LIST_GROUP_MEMBERS:
            return {"group": h["group"], "members": [
                {"client": c} for c in sorted(self.members.get(h["group"], {}))]}, b""
        if code == RequestCode.GET_OFFSET:
            return {"offset": self.offsets.get((h["group"], h["topic"], h["queue"]), -1)}, b""
        if code == RequestCode.QUERY_OFFSETS:
            return {"min": 0, "max": len(self.log[(h["topic"], h["queue"])])}, b""
        if code == RequestCode.COMMIT_OFFSET:
            refused = self._commit_rule(h, h["offset"])
            if refused is Refusal.BEHIND:
                raise OnceqError(ErrorCode.OFFSET_BEHIND, "below the committed offset")
            if refused is not None:
                raise OnceqError(ErrorCode.NOT_HOLDER, "not the holder")
            return {}, b""
        if code == RequestCode.RELEASE_QUEUE:
            return self._release(h), b""
        if code == RequestCode.LOCK_QUEUES:
            held = self.core.lock(h["group"], h["client"], [tuple(x) for x in h["queues"]],
                                  self.clock())
            return {"locked": [list(x) for x in sorted(held)]}, b""
        if code == RequestCode.UNLOCK_QUEUES:
            offsets = {(t, q): off for t, q, off in h["queues"]}

            def commit(tq: tuple[str, int]) -> None:
                if offsets[tq] >= 0:
                    self._commit_rule({**h, "topic": tq[0], "queue": tq[1]}, offsets[tq])

            done = self.core.unlock(h["group"], h["client"], list(offsets), self.clock(),
                                    commit)
            return {"unlocked": [list(x) for x in sorted(done)]}, b""
        if code == RequestCode.PULL:
            return self._pull(h)
        raise OnceqError(ErrorCode.BAD_REQUEST, f"the fake broker has no {code!r}")

    def _heartbeat(self, conn: FakeConnection, h: dict[str, Any]) -> dict[str, Any]:
        client = h["client"]
        conn.clients.add(client)
        answer: dict[str, Any] = {"expiry_s": 120, "holds": []}
        for g in h["groups"]:
            group = g["group"]
            members = self.members.setdefault(group, {})
            new = client not in members
            meta = g.get("meta", {})
            members[client] = _Member(conn, meta.get("access_lock", True),
                                      bool(meta.get("orderly")))
            if new:
                self._changed(group)
            locked = self._applies(group, client)
            held = [tuple(x) for x in g["held"]] if "held" in g else None
            holds, _ = self.core.heartbeat(group, client, held, g.get("reset_gen"),
                                           locked=locked, now=self.clock())
            answer["holds"] += [[group, t, q, has] for t, q, has in holds]
            if locked:
                answer["hold_s"] = self.hold_timeout
        self.core.touch_client(client, self.clock())
        return answer

    def _leave(self, group: str, client: str) -> None:
        if self.members.get(group, {}).pop(client, None) is not None:
            self.core.member_gone(group, client)
            self._changed(group)

    def _changed(self, group: str) -> None:
        if not self.notify:
            return
        for m in list(self.members.get(group, {}).values()):
            m.conn.push(PushCode.GROUP_CHANGED, {"group": group})

    def _applies(self, group: str, client: str) -> bool:
        m = self.members.get(group, {}).get(client)
        return self.access_lock and m is not None and m.access_lock and not m.orderly

    def _release(self, h: dict[str, Any]) -> dict[str, Any]:
        group, client, topic, queue = h["group"], h["client"], h["topic"], h["queue"]
        for held in [x for x in self._held.get((topic, queue), [])
                     if x.header["client"] == client]:
            self._answer(held, self._locked(held.header))
        offset = h.get("offset", -1)
        key = (group, topic, queue)
        released, d = self.core.release(group, client, topic, queue,
                                        offset if offset >= 0 else None,
                                        locked=self._applies(group, client),
                                        stored=self.offsets.get(key, -1),
                                        queue_max=len(self.log[(topic, queue)]),
                                        now=self.clock())
        if d is not None and d.write is not None:
            self.offsets[key] = d.write
        self._wake_held((topic, queue))
        return {"released": released}

    def _locked(self, h: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        return {"st": int(PullStatus.LOCKED), "next": h["offset"], "min": 0,
                "max": len(self.log[(h["topic"], h["queue"])])}, b""

    def _pull(self, h: dict[str, Any]) -> tuple[dict[str, Any], bytes] | asyncio.Future:
        group, client, topic, queue = h["group"], h["client"], h["topic"], h["queue"]
        if topic not in self.topics:
            raise OnceqError(ErrorCode.TOPIC_NOT_EXIST, topic)
        key = (group, topic, queue)
        h = dict(h)
        d = self.core.pull(group, client, topic, queue, h["offset"],
                           locked=self._applies(group, client),
                           ack=self.offsets.get(key, -1), now=self.clock())
        if d.refused is not None:
            return self._locked(h)
        if d.corrected:  # as the broker: a takeover's commit is its stale start
            h.pop("commit", None)
        h["offset"] = d.offset
        behind = None
        if h.get("commit", -1) >= 0 and self._commit_rule(
                h, h["commit"], checked=d.lock is not None) is Refusal.BEHIND:
            behind = self.offsets[key]
        h["behind"] = behind
        fut = asyncio.get_running_loop().create_future()
        held = _HeldPull(fut, h)
        if (topic, queue) in self.black_holes:
            return fut  # never answered: the client's request times out
        if not self._try(held, final=False):
            self._held.setdefault((topic, queue), []).append(held)
            held.timer = asyncio.get_running_loop().call_later(
                h["suspend_ms"] / 1000, self._expire, held)
        return fut

    def _try(self, held: _HeldPull, final: bool) -> bool:
        h = held.header
        records = self.log[(h["topic"], h["queue"])]
        key = (h["group"], h["topic"], h["queue"])
        if self._applies(h["group"], h["client"]) and self.holder(*key) != h["client"]:
            self._answer(held, self._locked(h))
            return True
        if h["offset"] >= len(records):
            if not final:
                # a holder whose pull is held is alive
                self.core.touch(h["group"], h["client"], h["topic"], h["queue"], self.clock())
                return False
            reply: dict[str, Any] = {"st": int(PullStatus.NO_NEW_MESSAGE), "next": h["offset"],
                                     "min": 0, "max": len(records)}
            payload = b""
        else:
            batch = records[h["offset"]:h["offset"] + h["max"]]
            nxt = h["offset"] + len(batch)
            self.core.delivered(*key, nxt)
            reply = {"st": int(PullStatus.FOUND), "next": nxt, "min": 0, "max": len(records)}
            payload = b"".join(batch)
        if h.get("behind") is not None:
            reply["behind"] = h["behind"]
        self._answer(held, (reply, payload))
        return True

    def _answer(self, held: _HeldPull, reply: tuple[dict[str, Any], bytes]) -> None:
        if held.timer is not None:
            held.timer.cancel()
        lst = self._held.get((held.header["topic"], held.header["queue"]), [])
        if held in lst:
            lst.remove(held)
        if not held.fut.done():
            held.fut.set_result(reply)

    def _expire(self, held: _HeldPull) -> None:
        self._try(held, final=True)

    def _wake_held(self, mq: tuple[str, int]) -> None:
        for held in list(self._held.get(mq, [])):
            self._try(held, final=False)

    def disconnect(self, conn: FakeConnection) -> None:
        for group, members in self.members.items():
            for client in [c for c, m in members.items() if m.conn is conn]:
                self._leave(group, client)
        for client in conn.clients:
            self.core.access.release_client(client)


class FakeConnection:
    """What ``BrokerConnection`` offers a push consumer, answered by a ``FakeBroker``."""

    def __init__(self, broker: FakeBroker, on_push: Callable[[int, dict[str, Any]], None]
                 ) -> None:
        self.broker = broker
        self.on_push = on_push
        self.clients: set[str] = set()
        self.closed = False
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._ids = itertools.count(1)

    async def request(self, code: int, header: dict[str, Any] | None = None,
                      payload: bytes = b"", timeout: float | None = 10.0
                      ) -> tuple[dict[str, Any], bytes]:
        if self.closed:
            raise ConnectionLost("connection to broker is closed")
        latency = self.broker.latency
        await asyncio.sleep(latency)
        if self.closed:
            raise ConnectionLost("connection to broker lost")
        reply = self.broker.handle(self, RequestCode(code), header or {})
        if isinstance(reply, asyncio.Future):
            try:
                reply = await asyncio.wait_for(asyncio.shield(reply), timeout)
            except TimeoutError:
                raise ConnectionLost(f"no reply within {timeout}s") from None
        await asyncio.sleep(latency)
        return reply

    def push(self, code: int, header: dict[str, Any]) -> None:
        if not self.closed:
            asyncio.get_running_loop().call_later(self.broker.latency, self._deliver, code,
                                                  header)

    def _deliver(self, code: int, header: dict[str, Any]) -> None:
        if not self.closed:
            self.on_push(code, header)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.lost.set_result(None)
            self.broker.disconnect(self)
