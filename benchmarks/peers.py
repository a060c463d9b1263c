"""Side-by-side benchmark of peer systems on loopback: Redis Streams and NATS JetStream.

Redis Streams is measured twice: on the server at 6379 as it is configured, and on a
server started for the run that fsyncs every write (``redis-always``, below).

The workload mirrors onceq's: fixed-size bodies, N messages, producer and consumer in
separate processes (fresh interpreters started with subprocess). The produce phase is timed
inside the producer process; once all N messages are stored, the consume phase is timed
inside the consumer process. Each figure is the median over ``repeats`` runs, every run on
a fresh stream that is deleted afterwards.

redis  produce: XADD, pipelined by B (B=1: one XADD per round trip), no MAXLEN.
       consume: XREADGROUP COUNT B, then one XACK carrying every id just read.
redis-always  the same workload on a second redis-server started for the run on a free
       loopback port, with ``--appendonly yes --appendfsync always --save ''`` in a temporary
       directory (every write fsynced to the AOF before the reply; a pipeline of B XADDs
       shares one fsync), stopped afterwards: the peer for onceq's sync flush. Unavailable
       when no ``redis-server`` binary is on the PATH.
nats   produce: file-storage stream; B=1 awaits each js.publish, B>1 issues B
                js.publish_async calls and then awaits their acks.
       consume: pull subscription, fetch(B), msg.ack() per message, flush at the end.

For B=1 at most n//10 messages are used to keep each run bounded; the count actually used
is reported under "n" for each batch size.

Usage: python benchmarks/peers.py --n 20000 --batches 1,32,100 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _progress import Steps, note

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
NATS_HOST, NATS_PORT = "127.0.0.1", 4222
NATS_URL = f"nats://{NATS_HOST}:{NATS_PORT}"
REDIS_ALWAYS = "redis-always"  # the private redis-server with appendfsync always

PROBE_TIMEOUT = 0.5  # seconds, availability check
IDLE_TIMEOUT = 10.0  # seconds without progress before a child gives up
CHILD_MIN_WAIT = 60.0  # seconds the parent waits for a child at least
SERVER_START_TIMEOUT = 15.0  # seconds a started redis-server has to answer PING


# --------------------------------------------------------------------------- availability


def _probe_redis(port: int = REDIS_PORT) -> bool:
    try:
        import redis  # noqa: F401
    except ImportError:
        return False
    try:
        with socket.create_connection((REDIS_HOST, port), timeout=PROBE_TIMEOUT) as s:
            s.settimeout(PROBE_TIMEOUT)
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _probe_nats() -> bool:
    try:
        import nats  # noqa: F401
    except ImportError:
        return False
    try:
        with socket.create_connection((NATS_HOST, NATS_PORT), timeout=PROBE_TIMEOUT) as s:
            s.settimeout(PROBE_TIMEOUT)
            buf = b""
            while b"\r\n" not in buf and len(buf) < 65536:
                chunk = s.recv(4096)
                if not chunk:
                    return False
                buf += chunk
    except OSError:
        return False
    line = buf.split(b"\r\n", 1)[0]
    if not line.startswith(b"INFO "):
        return False
    try:
        info = json.loads(line[5:])
    except ValueError:
        return False
    return bool(info.get("jetstream"))


def _can_start_redis() -> bool:
    """A redis-server binary on the PATH and the redis client installed."""
    try:
        import redis  # noqa: F401
    except ImportError:
        return False
    return shutil.which("redis-server") is not None


def available() -> dict[str, bool]:
    """Which peers answer on loopback right now (quick TCP check, short timeout); for
    ``redis-always``, whether a redis-server can be started."""
    return {"redis": _probe_redis(), "nats": _probe_nats(), REDIS_ALWAYS: _can_start_redis()}


# --------------------------------------------------------------------------- redis-always


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def redis_always_server() -> Iterator[int]:
    """Run a redis-server fsyncing every write (AOF, ``appendfsync always``, no RDB
    snapshots) in a temporary directory on a free loopback port; yield the port."""
    from throughput import _free_port

    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("no redis-server binary on the PATH")
    with tempfile.TemporaryDirectory(prefix="onceq-peer-redis-") as d:
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", REDIS_HOST, "--dir", d,
             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--daemonize", "no", "--logfile", os.path.join(d, "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + SERVER_START_TIMEOUT
            while not _probe_redis(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {port} did not start")
                time.sleep(0.05)
            yield port
        finally:
            _stop(proc)


# --------------------------------------------------------------------------- redis children


def _redis_client(port: int = REDIS_PORT):
    import redis

    return redis.Redis(host=REDIS_HOST, port=port, socket_timeout=IDLE_TIMEOUT)


def _redis_produce(key: str, n: int, batch: int, body_size: int,
                   port: int = REDIS_PORT) -> tuple[float, int]:
    r = _redis_client(port)
    try:
        r.ping()
        body = os.urandom(body_size)
        fields = {"d": body}
        t0 = time.perf_counter()
        if batch == 1:
            for _ in range(n):
                r.xadd(key, fields)
        else:
            sent = 0
            while sent < n:
                k = min(batch, n - sent)
                pipe = r.pipeline(transaction=False)
                for _ in range(k):
                    pipe.xadd(key, fields)
                pipe.execute()
                sent += k
        elapsed = time.perf_counter() - t0
        return n / elapsed, n
    finally:
        r.close()


def _redis_consume(key: str, group: str, n: int, batch: int,
                   port: int = REDIS_PORT) -> tuple[float, int]:
    r = _redis_client(port)
    try:
        r.ping()
        block_ms = int(IDLE_TIMEOUT * 1000)
        got = 0
        t0 = time.perf_counter()
        while got < n:
            resp = r.xreadgroup(group, "c1", {key: ">"}, count=batch, block=block_ms)
            if not resp:
                raise TimeoutError(f"no messages for {IDLE_TIMEOUT}s after {got}/{n}")
            ids = [mid for _, entries in resp for mid, _ in entries]
            r.xack(key, group, *ids)
            got += len(ids)
        elapsed = time.perf_counter() - t0
        return got / elapsed, got
    finally:
        r.close()


# --------------------------------------------------------------------------- nats children


async def _nats_connect():
    import nats

    return await nats.connect(NATS_URL, connect_timeout=2, max_reconnect_attempts=0)


async def _nats_produce_async(subject: str, n: int, batch: int, body_size: int) -> float:
    nc = await _nats_connect()
    try:
        js = nc.jetstream(timeout=IDLE_TIMEOUT)
        body = os.urandom(body_size)
        use_async = hasattr(js, "publish_async")
        if use_async and batch > 1 and hasattr(js, "_init_async_reply"):
            await js._init_async_reply()  # set up the ack inbox outside the timed section
        t0 = time.perf_counter()
        if batch == 1:
            for _ in range(n):
                await js.publish(subject, body)
        else:
            sent = 0
            while sent < n:
                k = min(batch, n - sent)
                if use_async:
                    futs = [await js.publish_async(subject, body) for _ in range(k)]
                else:
                    futs = [js.publish(subject, body) for _ in range(k)]
                await asyncio.wait_for(asyncio.gather(*futs), IDLE_TIMEOUT)
                sent += k
        elapsed = time.perf_counter() - t0
        return n / elapsed
    finally:
        await nc.close()


def _nats_produce(subject: str, n: int, batch: int, body_size: int) -> tuple[float, int]:
    return asyncio.run(_nats_produce_async(subject, n, batch, body_size)), n


async def _nats_consume_async(stream: str, subject: str, n: int, batch: int) -> tuple[float, int]:
    from nats.js.api import AckPolicy, ConsumerConfig

    nc = await _nats_connect()
    try:
        js = nc.jetstream(timeout=IDLE_TIMEOUT)
        config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=max(1000, batch))
        psub = await js.pull_subscribe(subject, durable="bench", stream=stream, config=config)
        got = 0
        t0 = time.perf_counter()
        while got < n:
            msgs = await psub.fetch(min(batch, n - got), timeout=IDLE_TIMEOUT)
            for msg in msgs:
                await msg.ack()
            got += len(msgs)
        await nc.flush(timeout=int(IDLE_TIMEOUT))
        elapsed = time.perf_counter() - t0
        return got / elapsed, got
    finally:
        await nc.close()


def _nats_consume(stream: str, subject: str, n: int, batch: int) -> tuple[float, int]:
    return asyncio.run(_nats_consume_async(stream, subject, n, batch))


_CHILDREN = {
    "redis_produce": _redis_produce,
    "redis_consume": _redis_consume,
    "nats_produce": _nats_produce,
    "nats_consume": _nats_consume,
}
CHILD_FLAG = "--peers-child"


def _child_main(role: str, args_json: str) -> int:
    """Entry point of a spawned child: run one timed phase, print the result as JSON."""
    try:
        rate, count = _CHILDREN[role](*json.loads(args_json))
    except Exception as exc:
        print(json.dumps({"error": repr(exc)}))
        return 1
    print(json.dumps({"rate": rate, "count": count}))
    return 0


# --------------------------------------------------------------------------- parent side


def _run_child(role: str, args: tuple, n: int) -> tuple[float, int]:
    """Run one phase in a fresh interpreter process; return (msgs_per_s, count)."""
    cmd = [sys.executable, os.path.abspath(__file__), CHILD_FLAG, role, json.dumps(list(args))]
    wait = max(CHILD_MIN_WAIT, n / 500.0)  # generous bound, never unbounded
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=wait)
    except subprocess.TimeoutExpired:  # subprocess.run kills the child before raising
        raise TimeoutError(f"{role} gave no result within {wait:.0f}s") from None
    lines = proc.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise RuntimeError(f"{role} gave no result: {tail[0]}") from None
    if "error" in out:
        raise RuntimeError(f"{role}: {out['error']}")
    return out["rate"], out["count"]


def _redis_once(n: int, batch: int, body_size: int,
                port: int = REDIS_PORT) -> tuple[float, float]:
    r = _redis_client(port)
    key = f"onceq-peer-{uuid.uuid4().hex[:12]}"
    group = "bench"
    try:
        r.xgroup_create(key, group, id="0", mkstream=True)
        prod, _ = _run_child("redis_produce", (key, n, batch, body_size, port), n)
        stored = r.xlen(key)
        if stored != n:
            raise RuntimeError(f"redis stream holds {stored} entries, expected {n}")
        cons, got = _run_child("redis_consume", (key, group, n, batch, port), n)
        if got != n:
            raise RuntimeError(f"redis consumer read {got}, expected {n}")
        return prod, cons
    finally:
        r.delete(key)
        r.close()


async def _nats_admin(action: str, stream: str, subject: str) -> int:
    from nats.js.api import StorageType, StreamConfig

    nc = await _nats_connect()
    try:
        js = nc.jetstream(timeout=IDLE_TIMEOUT)
        if action == "create":
            cfg = StreamConfig(name=stream, subjects=[subject], storage=StorageType.FILE)
            await js.add_stream(cfg)
            return 0
        if action == "count":
            info = await js.stream_info(stream)
            return info.state.messages
        await js.delete_stream(stream)
        return 0
    finally:
        await nc.close()


def _nats_once(n: int, batch: int, body_size: int) -> tuple[float, float]:
    stream = f"onceq_peer_{uuid.uuid4().hex[:12]}"
    subject = f"{stream}.msgs"
    asyncio.run(_nats_admin("create", stream, subject))
    try:
        prod, _ = _run_child("nats_produce", (subject, n, batch, body_size), n)
        stored = asyncio.run(_nats_admin("count", stream, subject))
        if stored != n:
            raise RuntimeError(f"nats stream holds {stored} messages, expected {n}")
        cons, got = _run_child("nats_consume", (stream, subject, n, batch), n)
        if got != n:
            raise RuntimeError(f"nats consumer read {got}, expected {n}")
        return prod, cons
    finally:
        try:
            asyncio.run(_nats_admin("delete", stream, subject))
        except Exception as exc:  # cleanup must not mask the run's own outcome
            print(f"peers: could not delete nats stream {stream}: {exc!r}", file=sys.stderr)


Once = Callable[[int, int, int], tuple[float, float]]
_RUNNERS: dict[str, Once] = {"redis": _redis_once, "nats": _nats_once,
                             REDIS_ALWAYS: _redis_once}


def _n_for(n: int, batch: int) -> int:
    return max(1, n // 10) if batch == 1 else n


def run_peers(n: int, batches: list[int], repeats: int = 3, body_size: int = 100) -> dict:
    """Benchmark every available peer; medians in msgs/s keyed by batch size (as str)."""
    if n < 1 or repeats < 1 or body_size < 0 or not batches or min(batches) < 1:
        raise ValueError("n, repeats and every batch must be >= 1, body_size >= 0")
    up = available()
    results: dict = {}
    steps = Steps(sum(up.values()) * len(batches) * repeats)
    for peer, once in _RUNNERS.items():
        if not up[peer]:
            note(f"{peer}: not available, skipped")
            results[peer] = {"available": False}
            continue
        if peer != REDIS_ALWAYS:
            results[peer] = _measure(peer, once, n, batches, repeats, body_size, steps)
            continue
        with contextlib.ExitStack() as stack:
            try:
                port = stack.enter_context(redis_always_server())
            except RuntimeError as exc:  # the server would not start: like a peer that is down
                note(f"{peer}: not available: {exc}")
                results[peer] = {"available": False, "reason": str(exc)}
                continue
            note(f"{peer}: redis-server with appendfsync always on port {port}")
            results[peer] = _measure(peer, functools.partial(once, port=port), n, batches,
                                     repeats, body_size, steps)
    return results


def _measure(peer: str, once: Once, n: int, batches: list[int], repeats: int,
             body_size: int, steps: Steps) -> dict:
    """One peer's medians per batch size, each over ``repeats`` runs of ``once``."""
    entry: dict = {"available": True, "produce": {}, "consume": {}, "n": {}}
    errors: dict = {}
    for batch in batches:
        m = _n_for(n, batch)
        prods, conss = [], []
        for r in range(repeats):
            steps.next(f"{peer}: batch={batch}, n={m}, run {r + 1}/{repeats}")
            try:
                p, c = once(m, batch, body_size)
            except Exception as exc:
                note(f"  {peer} failed: {exc!r}")
                errors[str(batch)] = repr(exc)
                break
            note(f"  {peer}: produce {p:.0f}/s, consume {c:.0f}/s")
            prods.append(p)
            conss.append(c)
        entry["n"][str(batch)] = m
        entry["produce"][str(batch)] = round(statistics.median(prods), 1) if prods else None
        entry["consume"][str(batch)] = round(statistics.median(conss), 1) if conss else None
    if errors:
        entry["errors"] = errors
    return entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--n", type=int, default=20000, help="messages per run (B=1 uses n//10)")
    ap.add_argument("--batches", default="1,32,100", help="comma-separated batch sizes")
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure (median reported)")
    ap.add_argument("--body-size", type=int, default=100, help="message body size in bytes")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    result = run_peers(args.n, batches, repeats=args.repeats, body_size=args.body_size)
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == CHILD_FLAG:
        sys.exit(_child_main(sys.argv[2], sys.argv[3]))
    sys.exit(main())
