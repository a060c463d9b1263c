"""A broker process on a real, small file system (an 8 MiB tmpfs) that fills up.

Sync flush, batches of 10 until the disk is full: the sends that do not fit get the stable
code ``DISK_FULL`` (no traceback per request in the broker's log), pulls are served all
along, a restart on the full disk serves every acknowledged message and nothing else, and
writes resume once space is freed. The usage ratio refuses writes before the disk is full
and lets them through again when usage drops.

Mounting needs root: as root (or in CI) a failed mount fails the test; elsewhere the tests
are skipped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from onceq import Admin, Producer
from onceq.client.message import Message
from onceq.client.pull import PullConsumer
from onceq.protocol.codes import PullStatus
from onceq.protocol.errors import ErrorCode, OnceqError
from tests.helpers import free_port, wait_until

TOPIC = "fill"
BODY = 1000
MIB = 1024 * 1024


_STARTED: list[subprocess.Popen[bytes]] = []


def _kill_started() -> None:
    """A failed test must not leave a broker running on the file system it unmounts."""
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs, unmounted afterwards."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    must = os.geteuid() == 0 or bool(os.environ.get("CI"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        msg = f"cannot mount a tmpfs at {mnt}: {r.stderr.strip() or r.returncode}"
        if must:
            pytest.fail(msg)
        pytest.skip(msg + " (needs root)")
    try:
        yield mnt
    finally:
        _kill_started()
        subprocess.run(["umount", "-l", str(mnt)], check=False)


class BrokerProc:
    """``onceq broker start`` in a child process, its log in a file outside the tmpfs."""

    def __init__(self, data_dir: Path, log_path: Path, *args: str) -> None:
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in stop/kill
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "onceq.cli.main", "broker", "start", "--data-dir",
             str(data_dir), "--port", str(self.port), "--log-level", "WARNING",
             "--flush", "sync", "--segment-size", str(MIB), "--max-body", "65536", *args],
            stdout=subprocess.DEVNULL, stderr=self.log)
        _STARTED.append(self.proc)

    async def ready(self) -> BrokerProc:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                _r, w = await asyncio.open_connection("127.0.0.1", self.port)
                w.close()
                return self
            except OSError:
                await asyncio.sleep(0.05)
        raise AssertionError("broker did not start: " + self.log_path.read_text())

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(30)
        self.log.close()
        return code


async def read_all(addr: str, queues: int) -> dict[str, tuple[int, int]]:
    """unique key -> (queue, offset) of every readable message."""
    out: dict[str, tuple[int, int]] = {}
    async with PullConsumer(addr, "reader") as c:
        for q in range(queues):
            off = 0
            while True:
                r = await c.pull(TOPIC, q, off, 256)
                if r.status != PullStatus.FOUND:
                    break
                for m in r.messages:
                    out[m.unique_key] = (q, m.queue_offset)
                off = r.next_offset
    return out


def fill_up(path: Path) -> None:
    """Write ``path`` until the file system has no byte left."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    with open(path, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0")
        except OSError:
            pass


def body(i: int) -> bytes:
    return f"{i:08d}".encode().ljust(BODY, b".")


async def test_disk_full_sync_broker(tmpfs: Path, tmp_path: Path):
    data = tmpfs / "data"
    log_path = tmp_path / "broker.log"
    filler = tmpfs / "filler"
    filler.write_bytes(b"\0" * MIB)  # freed later to make room
    b = await BrokerProc(data, log_path, "--disk-max-used-ratio", "1").ready()
    acked: dict[str, tuple[int, int]] = {}
    failed: list[ErrorCode] = []
    pulls = 0
    async with Admin(b.addr) as admin:
        await admin.create_topic(TOPIC, 2)
    async with Producer(b.addr, retries=0) as p, PullConsumer(b.addr, "watch") as c:
        i = 0
        while len(failed) < 40:
            batch = [Message(body(i + k)) for k in range(10)]
            i += 10
            try:
                rs = await p.send_batch(TOPIC, batch, queue=(i // 10) % 2)
            except OnceqError as exc:
                failed.append(exc.code)
            else:
                for r in rs:
                    acked[r.unique_key] = (r.queue_id, r.offset)
            if i % 200 == 0 or failed:  # the broker keeps serving pulls throughout
                r = await c.pull(TOPIC, 0, 0, 4)
                assert r.status == PullStatus.FOUND
                pulls += 1
            assert i < 20_000, "the disk never filled"
    assert len(acked) > 1000
    assert set(failed) == {ErrorCode.DISK_FULL}, failed
    # the producer's own retries end with the same clear code
    async with Producer(b.addr) as p:
        with pytest.raises(OnceqError) as ei:
            await p.send_batch(TOPIC, [Message(body(k)) for k in range(10)])
    assert ei.value.code == ErrorCode.DISK_FULL and "disk full" in ei.value.message
    text = log_path.read_text()
    assert "Traceback" not in text and "SYSTEM_ERROR" not in text
    assert len([ln for ln in text.splitlines() if "rolled back" in ln]) <= 3, text
    assert await read_all(b.addr, 2) == acked

    # killed and restarted on the full disk (not a byte left): it starts, serves every
    # acknowledged message and nothing else
    b.kill()
    fill_up(tmpfs / "top-up")
    b = await BrokerProc(data, log_path, "--disk-max-used-ratio", "1").ready()
    assert await read_all(b.addr, 2) == acked
    async with Producer(b.addr, retries=0) as p:
        with pytest.raises(OnceqError) as ei:
            await p.send_batch(TOPIC, [Message(body(k)) for k in range(10)], queue=1)
        assert ei.value.code == ErrorCode.DISK_FULL
    async with Admin(b.addr) as admin:  # a topic whose table cannot be written: no topic
        with pytest.raises(OnceqError) as ei:
            await admin.create_topic("late", 1)
        assert ei.value.code == ErrorCode.DISK_FULL
        assert [t["topic"] for t in await admin.list_topics()] == [TOPIC]
    assert await read_all(b.addr, 2) == acked
    # a clean stop on the full disk (checkpoint and offsets cannot be written) leaves a
    # state the next start reads
    async with PullConsumer(b.addr, "g") as c:
        await c.commit_offset(TOPIC, 0, 5)
    assert b.stop() == 0
    b = await BrokerProc(data, log_path, "--disk-max-used-ratio", "1").ready()
    assert await read_all(b.addr, 2) == acked
    # space comes back: writes resume without a restart
    filler.unlink()
    (tmpfs / "top-up").unlink()
    async with Producer(b.addr, retries=0) as p:
        rs = await p.send_batch(TOPIC, [Message(body(k)) for k in range(10)], queue=0)
    acked.update({r.unique_key: (r.queue_id, r.offset) for r in rs})
    b.stop()
    b = await BrokerProc(data, log_path).ready()
    assert await read_all(b.addr, 2) == acked
    async with Admin(b.addr) as admin:
        assert [t["topic"] for t in await admin.list_topics()] == [TOPIC]
    b.stop()
    assert "Traceback" not in log_path.read_text()


async def accepted(addr: str, want: bool) -> bool:
    """True when the broker's status says writes are accepted (``want``) or not."""
    async with Admin(addr) as admin:
        return (await admin.broker_status())["writes"]["accepted"] is want


async def test_usage_ratio_refuses_and_resumes(tmpfs: Path, tmp_path: Path):
    data = tmpfs / "data"
    log_path = tmp_path / "broker.log"
    b = await BrokerProc(data, log_path, "--disk-max-used-ratio", "0.5").ready()
    try:
        async with Admin(b.addr) as admin:
            await admin.create_topic(TOPIC, 1)
        async with Producer(b.addr, retries=0) as p, PullConsumer(b.addr, "g") as c:
            await p.send(TOPIC, b"before", queue=0)
            filler = tmpfs / "filler"
            filler.write_bytes(b"\0" * (5 * MIB))  # above half of 8 MiB
            # usage is measured at most once a second (the status measures it too)
            await wait_until(lambda: accepted(b.addr, False), 10, "writes refused", 0.1)
            with pytest.raises(OnceqError) as ei:
                await p.send(TOPIC, b"refused", queue=0)
            assert ei.value.code == ErrorCode.DISK_FULL
            async with Admin(b.addr) as admin:
                with pytest.raises(OnceqError) as ei:
                    await admin.create_topic("other", 1)
                assert ei.value.code == ErrorCode.DISK_FULL
                w = (await admin.broker_status())["writes"]
                assert not w["accepted"] and "DISK_FULL" in w["reason"]
                assert w["disk_used"] > 0.5 and w["disk_max_used"] == 0.5
            st = subprocess.run(
                [sys.executable, "-m", "onceq.cli.main", "broker", "status", "-b", b.addr],
                capture_output=True, text=True, timeout=60)
            assert "writes refused: DISK_FULL" in st.stdout, st.stdout + st.stderr
            # reads and offset commits go on
            r = await c.pull(TOPIC, 0, 0, 10, commit_offset=1)
            assert r.status == PullStatus.FOUND and [m.body for m in r.messages] == [b"before"]
            cli = subprocess.run(  # the CLI names the code
                [sys.executable, "-m", "onceq.cli.main", "send", TOPIC, "x", "-b", b.addr],
                capture_output=True, text=True, timeout=60)
            assert cli.returncode == 2 and "error: DISK_FULL: " in cli.stderr, cli.stderr
            filler.unlink()
            await wait_until(lambda: accepted(b.addr, True), 10, "writes accepted", 0.1)
            r2 = await p.send(TOPIC, b"after", queue=0)
            assert r2.offset == 1
            async with Admin(b.addr) as admin:
                assert (await admin.broker_status())["writes"]["accepted"]
        cli = subprocess.run(
            [sys.executable, "-m", "onceq.cli.main", "send", TOPIC, "x", "-b", b.addr],
            capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
    finally:
        b.stop()
    assert "Traceback" not in log_path.read_text()
