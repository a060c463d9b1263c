"""A broker started with ``--grpc-port`` in a child process, and the official RocketMQ
client run in children of its own (``rmq_proc.py``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from onceq import Admin, PullConsumer
from tests.helpers import free_port, spawn_broker, wait_port

PROC = Path(__file__).with_name("rmq_proc.py")


@dataclass
class RmqBroker:
    addr: str  # onceq's own port
    endpoint: str  # the RocketMQ gRPC endpoint
    home: Path  # HOME of the client processes (their log: logs/rocketmq_python/)

    def client(self, command: str, timeout: float = 60, **args: Any) -> dict[str, Any]:
        """Run one command of the official client; its JSON answer."""
        return self.result(self.start(command, **args), timeout)

    def start(self, command: str, **args: Any) -> subprocess.Popen[str]:
        """Start one command of the official client (``result`` waits for its answer)."""
        env = {**os.environ, "HOME": str(self.home)}
        return subprocess.Popen([sys.executable, str(PROC), self.endpoint, command,
                                 json.dumps(args)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)

    @staticmethod
    def result(p: subprocess.Popen[str], timeout: float = 60) -> dict[str, Any]:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            raise AssertionError(f"rmq_proc timed out:\n{err[-3000:]}") from None
        if p.returncode != 0:
            raise AssertionError(f"rmq_proc {p.args[3]} failed:\n{err[-3000:]}")
        return json.loads(out.strip().splitlines()[-1])

    def client_log(self) -> str:
        path = self.home / "logs" / "rocketmq_python" / "rocketmq_client.log"
        return path.read_text() if path.exists() else ""




def need_client() -> None:
    """Skip without grpc and the official client (the dev extra)."""
    for mod in ("grpc", "rocketmq.v5"):
        if importlib.util.find_spec(mod.split(".")[0]) is None:
            pytest.skip(f"{mod} is not installed (the dev extra)")


@contextmanager
def rmq_broker(root: Path, *args: str) -> Iterator[RmqBroker]:
    """A broker with the gRPC endpoint in a child process (``args``: more options)."""
    need_client()
    gport = free_port()
    proc, addr = spawn_broker(str(root / "data"), "--grpc-port", str(gport), *args)
    try:
        wait_port(gport, 15)
        yield RmqBroker(addr, f"127.0.0.1:{gport}", root)
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.fixture(scope="module")
def rmq(tmp_path_factory: Any) -> Iterator[RmqBroker]:
    with rmq_broker(tmp_path_factory.mktemp("rmq")) as b:
        yield b


async def make_topic(addr: str, topic: str, queues: int = 4) -> None:
    async with Admin(addr) as a:
        await a.create_topic(topic, queues)


async def read_all(addr: str, topic: str, queues: int = 4) -> list[Any]:
    """Every message of the topic, as onceq's own PullConsumer reads it."""
    out = []
    async with PullConsumer(addr, "reader") as c:
        for q in range(queues):
            offset = 0
            while True:
                r = await c.pull(topic, q, offset, 64)
                out += r.messages
                if not r.messages:
                    break
                offset = r.next_offset
    return out
