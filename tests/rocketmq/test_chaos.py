"""The official RocketMQ 5 clients while the broker is SIGKILLed and restarted.

``test_official_clients_through_broker_kills``: an official producer (sync sends, each
answered send recorded with its message id), a SimpleConsumer (receiving and
acknowledging by receipt handle, each acknowledgement answered OK recorded) and a
PushConsumer of another group run against a broker started with ``--grpc-port``; the
broker is SIGKILLed and started again (same data directory and ports) twice while they
run. Then:

* every acknowledged send is stored once, read back by onceq's own pull consumer
  (``lost`` = 0, ``stored_twice`` = 0: the retries of sends whose answer was lost are
  stored once, the dedup window surviving the kill);
* the SimpleConsumer's group received every acknowledged send, and the
  PushConsumer's group consumed every one (at least once);
* no message the SimpleConsumer acknowledged (answered OK) was delivered again afterwards
  (``redelivered_after_ack`` = 0), by a receive asked after the acknowledgement's answer;
  every message the PushConsumer consumed more than once had the acknowledgement of its
  earlier delivery refused as stale (``push_redelivered_after_ack`` = 0): it was in flight
  at a kill (at least once), not acknowledged.

``test_push_consumer_graceful_restart_consumes_the_rest_once``: a PushConsumer consumes
part of a topic, is shut down gracefully, and a new process of the same group consumes the
rest: nothing lost, nothing consumed twice.

``test_an_old_handle_is_refused_when_its_message_is_delivered_during_the_ack``: a receipt
handle of before a restart, acknowledged while a receive delivers its message again, is
refused.

``run_chaos`` is shared with ``benchmarks/rocketmq_chaos.py`` (a longer run, more kills).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from onceq import Admin, Producer, PullConsumer
from tests.helpers import free_port, wait_port

from .conftest import RmqBroker, need_client

LOAD = Path(__file__).with_name("rmq_load.py")
TOPIC, SIMPLE_GROUP, PUSH_GROUP, QUEUES = "rmq-chaos", "rmq-chaos-simple", "rmq-chaos-push", 4


# ---------------------------------------------------------------- processes
@dataclass
class Broker:
    """A broker child with the gRPC endpoint; SIGKILLed and started again on the same
    data directory and ports. Its stderr goes to a file (``broker.err``): a pipe nobody
    reads would stop it once full."""

    root: Path
    port: int = field(default_factory=free_port)
    gport: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.gport}"

    def start(self) -> None:
        self.starts += 1
        err = open(self.root / "broker.err", "ab")  # noqa: SIM115 (the child holds it)
        with err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "onceq.cli.main", "broker", "start", "--data-dir",
                 str(self.root / "data"), "--port", str(self.port), "--grpc-port",
                 str(self.gport), "--log-level", "WARNING"],
                stdout=subprocess.DEVNULL, stderr=err, env={**os.environ})
        try:
            wait_port(self.port, 30)
            wait_port(self.gport, 15)
        except AssertionError:
            self.stop()
            raise AssertionError(f"the broker did not start:\n{self.stderr()}") from None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(15)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)

    def stderr(self) -> str:
        path = self.root / "broker.err"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


class Load:
    """One command of ``rmq_load.py`` running in a process of its own."""

    def __init__(self, endpoint: str, home: Path, command: str, **args: Any) -> None:
        self.command = command
        self.p = subprocess.Popen(
            [sys.executable, str(LOAD), endpoint, command, json.dumps(args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env={**os.environ, "HOME": str(home)})
        self.expect("ready")

    def expect(self, word: str) -> None:
        """Wait for a line ``word`` on its stdout (its stdout is read nowhere else)."""
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if line.strip() != word:
            self.p.kill()
            _, err = self.p.communicate()
            raise AssertionError(f"{self.command}: {line!r} instead of {word!r}\n{err[-3000:]}")

    def stop(self, timeout: float = 30) -> dict[str, Any]:
        """A line on its stdin (a graceful stop); its JSON answer."""
        assert self.p.stdin is not None
        try:
            self.p.stdin.write("stop\n")
            self.p.stdin.flush()
        except BrokenPipeError:
            pass
        return RmqBroker.result(self.p, timeout)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.communicate()


def events(path: Path) -> list[list[str]]:
    """The lines ``rmq_load.py`` wrote, split (a line being written is left out)."""
    if not path.exists():
        return []
    text = path.read_text()
    return [line.split() for line in text[:text.rfind("\n") + 1].splitlines()]


def count(path: Path, kind: str) -> int:
    return sum(1 for e in events(path) if e[0] == kind)


def wait_for(pred: Any, timeout: float, what: str, interval: float = 0.1) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - t0


async def _create_topic(addr: str, topic: str, queues: int) -> None:
    async with Admin(addr) as a:
        await a.create_topic(topic, queues)


async def stored_keys(addr: str, topic: str, queues: int) -> collections.Counter[str]:
    """Every unique key stored in ``topic``, read with onceq's own pull consumer."""
    keys: collections.Counter[str] = collections.Counter()
    async with PullConsumer(addr, "rmq-chaos-audit") as c:
        for q in range(queues):
            offset = 0
            while True:
                r = await c.pull(topic, q, offset, 256, suspend=0)
                if not r.messages:
                    break
                keys.update(m.unique_key for m in r.messages)
                offset = r.next_offset
    return keys


# ---------------------------------------------------------------- the chaos run
def run_chaos(root: Path, kills: int = 2, progress: int = 150, rate: float = 300,
              producers: int = 1, simples: int = 1, drain_s: float = 45) -> dict[str, Any]:
    """``producers`` producers (``rate`` sends a second in all), ``simples``
    SimpleConsumers of one group and a PushConsumer of another on one topic; before each
    of ``kills`` SIGKILLs (and after the last restart) the sends answered, the
    acknowledgements answered and the consumptions have each grown by ``progress``.
    Returns what was measured (``analyse``)."""
    root.mkdir(parents=True, exist_ok=True)
    broker = Broker(root)
    broker.start()
    asyncio.run(_create_topic(broker.addr, TOPIC, QUEUES))
    sent_files = [root / f"sent-{i}.log" for i in range(producers)]
    simple_files = [root / f"simple-{i}.log" for i in range(simples)]
    push_file = root / "push.log"
    loads: list[Load] = []
    t_start = time.monotonic()
    downtime: list[float] = []
    killed_at: list[float] = []  # time.monotonic(), as the events
    try:
        prods = [Load(broker.endpoint, root, "produce_live", topic=TOPIC, out=str(f),
                      prefix=f"p{i}", rate=rate / producers)
                 for i, f in enumerate(sent_files)]
        loads += prods
        simple = [Load(broker.endpoint, root, "simple_live", topic=TOPIC,
                       group=SIMPLE_GROUP, out=str(f), invisible=10) for f in simple_files]
        push = Load(broker.endpoint, root, "push_live", topic=TOPIC, group=PUSH_GROUP,
                    out=str(push_file))
        loads += [*simple, push]

        def simple_events() -> list[list[str]]:
            """The SimpleConsumers' events, in the order of their times."""
            merged = [e for f in simple_files for e in events(f)]
            return sorted(merged, key=lambda e: float(e[1]))

        def counts() -> tuple[int, int, int]:
            return (sum(count(f, "S") for f in sent_files),
                    sum(count(f, "A") for f in simple_files), count(push_file, "C"))

        def progressed(since: tuple[int, int, int]) -> bool:
            return all(now >= before + progress for now, before in zip(counts(), since,
                                                                      strict=True))

        for _ in range(kills + 1):
            since = counts()
            wait_for(lambda s=since: progressed(s), 60,  # type: ignore[misc]
                     f"{progress} more sends, acks and consumptions than {since}")
            if len(downtime) == kills:
                break
            t_kill = time.monotonic()
            broker.kill()
            killed_at.append(t_kill)
            broker.start()  # the same data directory and ports
            downtime.append(time.monotonic() - t_kill)
        produced = [p.stop() for p in prods]
        sent: dict[str, str] = {}  # message id -> body, of every answered send
        for f in sent_files:
            sent.update((e[2], e[3]) for e in events(f) if e[0] == "S")

        def drained() -> bool:
            received = {e[2] for e in simple_events() if e[0] == "R"}
            pushed = {e[2] for e in events(push_file) if e[0] == "C"}
            return set(sent) <= received and set(sent) <= pushed

        try:
            drain = wait_for(drained, drain_s, "every answered send consumed by both groups",
                             interval=0.2)
        except AssertionError:
            drain = None
        simple_out, push_out = [c.stop() for c in simple], push.stop()
        stored = asyncio.run(stored_keys(broker.addr, TOPIC, QUEUES))
    finally:
        for load in loads:
            load.kill()
        broker.stop()
    return analyse(sent, stored, simple_events(), events(push_file),
                   stale_acks(root, PUSH_GROUP)) | {
        "kills": kills, "seconds": round(time.monotonic() - t_start, 1),
        "broker_restart_s": [round(d, 2) for d in downtime], "killed_at": killed_at,
        "drain_s": None if drain is None else round(drain, 1),
        "producers": produced, "simple_consumers": simple_out, "push_consumer": push_out}


def stale_acks(home: Path, group: str) -> collections.Counter[str]:
    """Per message id, the acknowledgements of the PushConsumers of ``group`` refused
    ``INVALID_RECEIPT_HANDLE`` (after a broker restart: the message was delivered again
    since), as the official client 5.1.2 logs them (it gives such an ack up)."""
    path = home / "logs" / "rocketmq_python" / "rocketmq_client.log"
    refused: collections.Counter[str] = collections.Counter()
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            if f"PUSH_CONSUMER:{group}," in line and "invalid receipt handle" in line:
                refused[line.rsplit("message_id: ", 1)[-1].strip()] += 1
    return refused


def analyse(sent: dict[str, str], stored: collections.Counter[str], simple: list[list[str]],
            push: list[list[str]], push_refused: collections.Counter[str]
            ) -> dict[str, Any]:
    """The checks of a chaos run, from the events the client processes recorded
    (``simple``: in the order of their times; a receive is timed when it was asked, an
    acknowledgement when it was answered, so a receive after an acknowledgement was asked
    once the broker had answered it). A PushConsumer acknowledges each message it consumed
    until the ack is answered OK or refused as stale: each consumption beyond the first
    needs a refused acknowledgement, otherwise an acknowledged message came back."""
    first_ack: dict[str, float] = {}
    received: collections.Counter[str] = collections.Counter()
    redelivered_after_ack = []
    for e in simple:
        kind, t, mid = e[0], float(e[1]), e[2]
        if kind == "R":
            received[mid] += 1
            if mid in first_ack and t > first_ack[mid]:
                redelivered_after_ack.append(mid)
        elif kind == "A":
            first_ack.setdefault(mid, t)
    consumed = collections.Counter(e[2] for e in push if e[0] == "C")
    return {
        "sends_answered": len(sent),
        "messages_stored": len(stored),
        "lost": sorted(set(sent) - set(stored)),
        "stored_twice": sorted(k for k, n in stored.items() if n > 1 and k in sent),
        "simple_not_received": sorted(set(sent) - set(received)),
        "simple_acked": len(first_ack),
        # its acknowledgement failed (the broker was killed: it may have been stored, the
        # answer lost) and it was not delivered again
        "simple_ack_unanswered": sorted(set(received) - set(first_ack)),
        "simple_deliveries_beyond_first": sum(n - 1 for n in received.values()),
        "redelivered_after_ack": sorted(set(redelivered_after_ack)),
        "push_not_consumed": sorted(set(sent) - set(consumed)),
        "push_consumed": len(consumed),
        "push_consumed_beyond_first": sum(n - 1 for n in consumed.values()),
        "push_stale_acks_refused": sum(push_refused.values()),
        "push_redelivered_after_ack": sorted(k for k, n in consumed.items()
                                             if n - 1 > push_refused[k]),
    }


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_official_clients_through_broker_kills(tmp_path: Path) -> None:
    need_client()
    result = run_chaos(tmp_path, kills=2, progress=100)
    print("rocketmq chaos:", json.dumps({k: v if not isinstance(v, list) or len(v) < 10
                                         else f"{len(v)} items" for k, v in result.items()}))
    assert result["sends_answered"] >= 300, result
    assert result["lost"] == [], result  # every acknowledged send is readable
    assert result["stored_twice"] == [], result
    assert result["simple_not_received"] == [], result  # and was consumed by both groups
    assert result["push_not_consumed"] == [], result
    # acknowledged by receipt handle, then delivered again: never
    assert result["redelivered_after_ack"] == [], result
    assert result["push_redelivered_after_ack"] == [], result


# ---------------------------------------------------------------- a graceful restart
PUSH_TOPIC, PUSH_RESTART_GROUP = "rmq-push-restart", "rmq-push-restart-g"


async def _fill(addr: str, n: int) -> list[str]:
    bodies = [f"pr-{i}" for i in range(n)]
    async with Admin(addr) as a:
        await a.create_topic(PUSH_TOPIC, QUEUES)
    async with Producer(addr) as p:
        for q in range(QUEUES):
            await p.send_batch(PUSH_TOPIC, [b.encode() for b in bodies[q::QUEUES]], queue=q)
    return bodies


@pytest.mark.timeout(90)
def test_push_consumer_graceful_restart_consumes_the_rest_once(rmq: RmqBroker,
                                                                tmp_path: Path) -> None:
    n = 400
    bodies = asyncio.run(_fill(rmq.addr, n))
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    c1 = Load(rmq.endpoint, tmp_path, "push_live", topic=PUSH_TOPIC,
              group=PUSH_RESTART_GROUP, out=str(first), handler_ms=20, threads=2,
              cache=64, stop_after=n // 3)
    try:
        c1.expect("enough")  # a third consumed, more received and in flight
        out1 = c1.stop()
    finally:
        c1.kill()
    before = [e[3] for e in events(first) if e[0] == "C"]
    assert n // 3 <= len(before) < n, out1
    c2 = Load(rmq.endpoint, tmp_path, "push_live", topic=PUSH_TOPIC,
              group=PUSH_RESTART_GROUP, out=str(second))
    try:
        wait_for(lambda: {e[3] for e in events(second) if e[0] == "C"} | set(before)
                 >= set(bodies), 40, "the rest consumed by the new process")
        time.sleep(1)  # anything delivered again would come now
        out2 = c2.stop()
    finally:
        c2.kill()
    after = [e[3] for e in events(second) if e[0] == "C"]
    again = sorted(set(before) & set(after))
    dup1 = [b for b, k in collections.Counter(before).items() if k > 1]
    dup2 = [b for b, k in collections.Counter(after).items() if k > 1]
    print(f"push restart: first {len(before)} {out1}, then {len(after)} {out2}")
    assert set(before) | set(after) == set(bodies)  # nothing lost
    assert again == [], f"{len(again)} consumed before the restart came again: {again[:10]}"
    assert dup1 == [] and dup2 == []


# ---------------------------------------------------------------- a race of an old handle
async def test_an_old_handle_is_refused_when_its_message_is_delivered_during_the_ack(
        tmp_path: Path) -> None:
    """After a restart of the endpoint, the acknowledgement of a handle received before it
    and a receive of the same group run at once; the broker answers the acknowledgement's
    GetOffset a moment later (as ``Bridge.call`` allows), and the receive delivers the
    message again meanwhile. Only the newest handle may count: the old one must be refused
    (``INVALID_RECEIPT_HANDLE``), or the consumer, told its acknowledgement succeeded, gets
    the message again."""
    import contextvars

    import grpc  # noqa: F401 (the grpc extra)

    from onceq.protocol.requests import GetOffset
    from onceq.rocketmq.consume import Receive
    from onceq.rocketmq.mapping import Code, RmqError
    from onceq.rocketmq.server import GrpcFrontEnd
    from tests.helpers import running_broker

    topic, group = "rmq-race", "rmq-race-g"
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as a:
            await a.create_topic(topic, 1)
        async with Producer(addr) as p:
            await p.send(topic, b"m", queue=0)
        first = GrpcFrontEnd(free_port())
        await first.start(b)
        assert first.service is not None
        got = await first.service.pop.receive(Receive(group, topic, None, 1, 60, 0))
        old = got[0].system_properties.receipt_handle
        await first.stop()  # the endpoint restarts: the delivery in flight is not kept

        second = GrpcFrontEnd(free_port())
        await second.start(b)
        try:
            assert second.service is not None
            pop = second.service.pop
            in_ack = contextvars.ContextVar("in_ack", default=False)
            delivered = asyncio.Event()
            call = pop.bridge.call

            async def slow_get_offset(conn: Any, req: Any) -> Any:
                if in_ack.get() and isinstance(req, GetOffset):
                    await delivered.wait()  # answered a moment later
                return await call(conn, req)

            pop.bridge.call = slow_get_offset  # type: ignore[method-assign]

            async def ack() -> None:
                in_ack.set(True)
                await pop.ack(group, topic, old)

            acking = asyncio.create_task(ack())
            await asyncio.sleep(0.05)  # the ack waits for its GetOffset
            again = await pop.receive(Receive(group, topic, None, 1, 60, 0))
            assert [m.body for m in again] == [b"m"]  # delivered again, a new handle
            delivered.set()
            with pytest.raises(RmqError) as e:  # the old handle is stale now
                await acking
            assert e.value.code == Code.INVALID_RECEIPT_HANDLE
            await pop.ack(group, topic, again[0].system_properties.receipt_handle)
        finally:
            await second.stop()
