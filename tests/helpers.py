"""Test helpers: brokers in-process and in a child process."""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

from onceq.broker.broker import Broker
from onceq.broker.config import BrokerConfig
from onceq.client.admin import Admin
from onceq.storage.config import StoreConfig
from onceq.storage.files import OS_FILES, FileOps
from onceq.storage.store import MessageStore


def small_store(data_dir: str, **kw: Any) -> StoreConfig:
    kw.setdefault("segment_size", 256 * 1024)
    kw.setdefault("index_entries_per_file", 1000)
    kw.setdefault("max_body", 64 * 1024)
    kw.setdefault("flush_interval_ms", 50)
    kw.setdefault("checkpoint_interval_ms", 100)
    kw.setdefault("disk_max_used_ratio", 1.0)  # not this host's disk usage (see conftest)
    return StoreConfig(data_dir, **kw)


@asynccontextmanager
async def running_broker(data_dir: str, store_kw: dict[str, Any] | None = None,
                         files: FileOps = OS_FILES, **kw: Any):
    kw.setdefault("port", 0)
    broker = Broker(BrokerConfig(small_store(data_dir, **(store_kw or {})), **kw), files=files)
    await broker.start()
    try:
        yield broker
    finally:
        await broker.stop()


_HANDED_OUT: deque[int] = deque(maxlen=1024)  # ports free_port gave lately


def free_port() -> int:
    """A port free on loopback now, and not one this process was given lately: two picks
    in a row may get the same free port (a broker binds it only later), as once happened
    to two brokers of one group."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.append(port)
            return port


def with_fd_limit(argv: list[str], fd_limit: int | None) -> list[str]:
    """``argv`` run under a limit on open file descriptors (``ulimit -n``), set by a small
    parent of its own that then execs it (not by a ``preexec_fn``: a fork of the test
    process, which may hold gRPC's threads, is not safe)."""
    if fd_limit is None:
        return argv
    return [sys.executable, "-c", "import os, resource, sys; resource.setrlimit("
            f"resource.RLIMIT_NOFILE, ({fd_limit}, {fd_limit})); "
            "os.execv(sys.argv[1], sys.argv[1:])", *argv]


def wait_port(port: int, timeout: float = 15.0) -> None:
    """Wait until something accepts connections on loopback ``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {timeout}s")


def spawn_broker(data_dir: str, *args: str, port: int | None = None,
                 fd_limit: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``onceq broker start`` in a child process and wait until it accepts;
    ``fd_limit``: the child's limit on open file descriptors (``ulimit -n``)."""
    port = port or free_port()
    proc = subprocess.Popen(
        with_fd_limit([sys.executable, "-m", "onceq.cli.main", "broker", "start",
                       "--data-dir", data_dir, "--port", str(port), "--log-level", "WARNING",
                       *args], fd_limit),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ},
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"broker exited: {proc.stderr.read().decode()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("broker did not start")


def kill_store(store: MessageStore) -> None:
    """Drop a store as a killed process would: no checkpoint, no offsets snapshot, no
    fsync (the page cache keeps what was written)."""
    store.log.close()
    for cq in store.queues.values():
        cq.close()
    store.open_files.close_all()


def module_broker(tmp_path_factory: Any, name: str, *args: str) -> Iterator[str]:
    """The body of a module-scoped broker fixture: a child broker with ``args``, its
    address yielded, terminated afterwards."""
    proc, addr = spawn_broker(str(tmp_path_factory.mktemp(name) / "data"), *args)
    try:
        yield addr
    finally:
        proc.terminate()
        proc.wait(10)


async def wait_until(pred: Callable[[], Any], timeout: float, what: str,
                     interval: float = 0.02) -> float:
    """Poll ``pred`` (a function, or one returning an awaitable) until its result is true;
    return the seconds it took. Fails after ``timeout`` seconds."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    while True:
        ok = pred()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return time.monotonic() - t0
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def admin(addr: str, fn: Callable[[Admin], Awaitable[Any]]) -> Any:
    """``await fn(admin)`` on an Admin client of ``addr``, from synchronous test code."""
    async def go() -> Any:
        async with Admin(addr) as a:
            return await fn(a)
    return asyncio.run(go())
