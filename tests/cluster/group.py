"""A broker group for the tests: brokers as child processes (``onceq broker start
--cluster ...``) on free loopback ports, each with its data directory, and what the tests
ask of them (who leads, their logs' bytes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from onceq.client.connection import BrokerConnection
from onceq.protocol.replies import Pong
from onceq.protocol.requests import Ping
from onceq.storage.commitlog import CommitLog
from tests.helpers import free_port


@dataclass
class Node:
    broker_id: str
    port: int
    data: Path
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None
    stderr: Path = field(default_factory=Path)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.stderr = self.data.parent / f"broker-{self.broker_id}.log"
        err = self.stderr.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "onceq.cli.main", "broker", "start", "--data-dir",
             str(self.data), "--port", str(self.port), "--log-level", "INFO", *self.args],
            stdout=subprocess.DEVNULL, stderr=err, env={**os.environ})
        err.close()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def log_bytes(self, end: int | None = None) -> bytes:
        """The commit log's bytes from the start (up to ``end``), read from the files."""
        log = CommitLog(str(self.data / "commitlog"), 1 << 30)
        try:
            log.open()
            stop = log.end if end is None else min(end, log.end)
            return log.read(log.start, stop - log.start) if stop > log.start else b""
        finally:
            log.close()

    def tail(self) -> str:
        try:
            return self.stderr.read_text(errors="replace")[-3000:]
        except OSError:
            return ""


def make_group(tmp: Path, etcd: str, cluster: str, n: int = 3, *extra: str) -> list[Node]:
    nodes = []
    for i in range(1, n + 1):
        data = tmp / f"b{i}" / "data"
        data.parent.mkdir(parents=True, exist_ok=True)
        args = ["--cluster", f"etcd://{etcd}", "--cluster-name", cluster, "--group", "g1",
                "--broker-id", str(i), "--session-ttl", "2", "--auto-create-topics",
                "--replica-lag-max-ms", "1000", "--replica-ack-timeout-ms", "2000",
                "--replica-fetch-wait-ms", "200", "--expiry-check", "0.2", *extra]
        nodes.append(Node(str(i), free_port(), data, args))
    for node in nodes:
        node.start()
    return nodes


async def ping(address: str) -> bool:
    try:
        conn = await BrokerConnection.open(address)  # type: ignore[attr-defined]
    except OSError:
        return False
    try:
        return isinstance(await conn.call(Ping(), 1.0), Pong)
    except Exception:
        return False
    finally:
        conn.close()


def deadline(seconds: float) -> float:
    return time.monotonic() + seconds
