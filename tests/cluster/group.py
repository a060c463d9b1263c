"""A broker group for the tests: brokers as child processes (``onceq broker start
--cluster ...``) on free loopback ports, each with its data directory, and what the tests
ask of them (who leads, their logs' bytes)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from onceq.client.connection import BrokerConnection
from onceq.client.message import Message
from onceq.client.producer import Producer
from onceq.client.pull import PullConsumer
from onceq.protocol.codes import PullStatus
from onceq.protocol.errors import OnceqError
from onceq.protocol.replies import Pong, StatusReply
from onceq.protocol.requests import BrokerStatus, Ping
from onceq.storage.commitlog import CommitLog
from tests.helpers import free_port, wait_until


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


def make_group(tmp: Path, etcd: str, cluster: str, n: int = 3, *extra: str,
               etcds: list[str] | None = None, ports: list[int] | None = None,
               advertised: list[str] | None = None, group: str = "g1") -> list[Node]:
    """``etcds``: one etcd endpoint per broker (a proxy each), instead of ``etcd``;
    ``ports``: the brokers' ports (default: free ones); ``advertised``: the address each
    broker gives the others and the clients (``--advertised-address``, e.g. a proxy);
    ``group``: the group's name (its brokers' data under ``tmp/b<i>``)."""
    nodes = []
    for i in range(1, n + 1):
        if etcds is not None:
            etcd = etcds[i - 1]
        data = tmp / f"b{i}" / "data"
        data.parent.mkdir(parents=True, exist_ok=True)
        args = ["--cluster", f"etcd://{etcd}", "--cluster-name", cluster, "--group", group,
                "--broker-id", str(i), "--session-ttl", "2", "--auto-create-topics",
                "--replica-lag-max-ms", "1000", "--replica-ack-timeout-ms", "2000",
                "--replica-fetch-wait-ms", "200", "--expiry-check", "0.2", *extra]
        if advertised is not None:
            args += ["--advertised-address", advertised[i - 1]]
        nodes.append(Node(str(i), free_port() if ports is None else ports[i - 1], data, args))
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


async def status(node: Node) -> dict | None:
    """The broker's group status (``BROKER_STATUS``'s ``cluster``), None when unreachable."""
    try:
        conn = await BrokerConnection.open(node.address, timeout=0.5)
    except (OnceqError, OSError):
        return None
    try:
        reply: StatusReply = await conn.call(BrokerStatus(), 1.0)
        return reply.cluster
    except (OnceqError, OSError, TimeoutError):
        return None
    finally:
        conn.close()


async def leader_of(nodes: list[Node], timeout: float = 15.0,
                    isr: int | None = None) -> Node:
    """The one node that leads (and, with ``isr``, has that many replicas in sync)."""
    found: list[Node] = []

    async def one() -> bool:
        found.clear()
        for n in nodes:
            st = await status(n)
            if st and st.get("role") == "leader" and (isr is None or len(st["isr"]) == isr):
                found.append(n)
        return len(found) == 1

    await wait_until(one, timeout, "one leader", interval=0.1)
    return found[0]


async def send(address: str, topic: str, body: str, key: str, retries: int = 0) -> int:
    async with Producer(address, retries=retries, send_timeout=3.0) as p:
        r = await p.send(topic, Message(body.encode(), unique_key=key), queue=0)
        return r.offset if not r.duplicate else -1 - r.offset


async def pull_all(address: str, topic: str) -> list[bytes]:
    out: list[bytes] = []
    async with PullConsumer(address, "g") as c:
        offset = 0
        while True:
            r = await c.pull(topic, 0, offset, 64)
            if r.status != PullStatus.FOUND:
                return out
            out += [m.body for m in r.messages]
            offset = r.next_offset


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as answer:
            return b'"true"' in answer.read()
    except OSError:
        return False


class Etcd:
    """A single-member etcd on loopback (``start`` / ``stop`` keep its data dir and ports),
    with ``pause`` / ``resume`` (SIGSTOP / SIGCONT) to take it down without losing state."""

    def __init__(self, binary: str, data: Path) -> None:
        self.binary, self.data = binary, data
        self.client = f"http://127.0.0.1:{free_port()}"
        self.peer = f"http://127.0.0.1:{free_port()}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._new = True

    @property
    def endpoint(self) -> str:
        return self.client.removeprefix("http://")

    def start(self) -> str:
        """Start it and wait until healthy; RuntimeError when it does not become so."""
        log = (self.data / "etcd.log").open("ab")
        # heartbeat 50 ms / election 500 ms: etcd's shortest lease is then 1 s (not 2 s)
        self.proc = subprocess.Popen(
            [self.binary, "--name", "onceq-test", "--data-dir", str(self.data / "member"),
             "--listen-client-urls", self.client, "--advertise-client-urls", self.client,
             "--listen-peer-urls", self.peer, "--initial-advertise-peer-urls", self.peer,
             "--initial-cluster", f"onceq-test={self.peer}",
             "--initial-cluster-state", "new" if self._new else "existing",
             "--heartbeat-interval", "50", "--election-timeout", "500",
             "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._new = False
        limit = time.monotonic() + 20
        while not _healthy(self.client):
            if self.proc.poll() is not None or time.monotonic() > limit:
                tail = (self.data / "etcd.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"etcd did not become healthy at {self.client}:\n{tail}")
            time.sleep(0.05)
        return self.endpoint

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self.resume()
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@contextlib.contextmanager
def start_etcd(binary: str, data: Path) -> Iterator[str]:
    """A single-member etcd on free loopback ports with its data in ``data``, killed on
    exit; yields ``127.0.0.1:PORT``. RuntimeError when it does not become healthy."""
    etcd = Etcd(binary, data)
    try:
        yield etcd.start()
    finally:
        etcd.stop()
