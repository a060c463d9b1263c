"""POP consumption across a broker SIGKILL: the official SimpleConsumer acknowledges some
messages before the kill (above messages still in flight, so the group's offset cannot
cover them), the broker is killed and restarted, the consumer then acknowledges more with
the receipt handles it got before the kill. Acknowledged messages are never delivered
again; the handles of before the restart stay valid; what was never acknowledged comes
back."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from pathlib import Path

from onceq import Admin, Producer
from tests.helpers import free_port, spawn_broker, wait_port

from .conftest import RmqBroker, need_client

TOPIC, GROUP = "rmq-restart", "rmq-restart-g"


async def _prepare(addr: str, n: int) -> None:
    async with Admin(addr) as a:
        await a.create_topic(TOPIC, 2)
    async with Producer(addr) as p:
        for i in range(n):
            await p.send(TOPIC, f"r-{i}".encode(), queue=i % 2)


def _restart(root: Path, proc: subprocess.Popen[bytes], port: int, gport: int
             ) -> subprocess.Popen[bytes]:
    proc.send_signal(signal.SIGKILL)
    proc.wait(15)
    proc, _ = spawn_broker(str(root / "data"), "--grpc-port", str(gport), port=port)
    wait_port(gport, 15)
    return proc


def test_acknowledged_never_delivered_again_and_handles_survive_a_sigkill(tmp_path: Path):
    n = 12
    bodies = [f"r-{i}" for i in range(n)]
    first = [b for i, b in enumerate(bodies) if i % 3 == 1]  # acked before the kill
    later = [b for i, b in enumerate(bodies) if i % 3 == 2]  # acked after, old handles
    never = [b for i, b in enumerate(bodies) if i % 3 == 0]  # never acked: come back
    need_client()
    port, gport = free_port(), free_port()
    proc, addr = spawn_broker(str(tmp_path / "data"), "--grpc-port", str(gport), port=port)
    try:
        wait_port(gport, 15)
        b = RmqBroker(addr, f"127.0.0.1:{gport}", tmp_path)
        asyncio.run(_prepare(addr, n))
        holder = b.start("simple_hold", topic=TOPIC, group=GROUP, n=n, ack_first=first,
                         ack_later=later, invisible=60)
        assert holder.stdout is not None and holder.stdin is not None
        line = holder.stdout.readline()
        assert line.startswith("received "), b.result(holder)
        assert json.loads(line.split(" ", 1)[1]) == sorted(bodies)
        proc = _restart(tmp_path, proc, port, gport)  # between ack and restart, and
        holder.stdin.write("go\n")  # between receive and ack
        holder.stdin.flush()
        out = b.result(holder)
        assert out["acks"] == {x: "ok" for x in later}  # the handles stayed valid
        # a new consumer of the group: only the never acknowledged come back
        again = b.client("simple", topic=TOPIC, group=GROUP, n=len(never), invisible=5,
                         drain=True, timeout=30)
        assert sorted(r["body"] for r in again["received"]) == sorted(never)
        assert again["extra"] == []
    finally:
        proc.terminate()
        proc.wait(15)
