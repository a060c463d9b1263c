"""Side-by-side benchmark of peer systems on loopback: Redis Streams and NATS JetStream.

The workload mirrors onceq's: fixed-size bodies, N messages, producer and consumer in
separate processes (fresh interpreters started with subprocess). The produce phase is timed
inside the producer process; once all N messages are stored, the consume phase is timed
inside the consumer process. Each figure is the median over ``repeats`` runs, every run on
a fresh stream that is deleted afterwards.

redis  produce: XADD, pipelined by B (B=1: one XADD per round trip), no MAXLEN.
       consume: XREADGROUP COUNT B, then one XACK carrying every id just read.
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
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _progress import Steps, note

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
NATS_HOST, NATS_PORT = "127.0.0.1", 4222
NATS_URL = f"nats://{NATS_HOST}:{NATS_PORT}"

PROBE_TIMEOUT = 0.5  # seconds, availability check
IDLE_TIMEOUT = 10.0  # seconds without progress before a child gives up
CHILD_MIN_WAIT = 60.0  # seconds the parent waits for a child at least


# --------------------------------------------------------------------------- availability


def _probe_redis() -> bool:
    try:
        import redis  # noqa: F401
    except ImportError:
        return False
    try:
        with socket.create_connection((REDIS_HOST, REDIS_PORT), timeout=PROBE_TIMEOUT) as s:
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


def available() -> dict[str, bool]:
    """Which peers answer on loopback right now (quick TCP check, short timeout)."""
    return {"redis": _probe_redis(), "nats": _probe_nats()}


# --------------------------------------------------------------------------- redis children


def _redis_client():
    import redis

    return redis.Redis(host=REDIS_HOST, port=REDIS_PORT, socket_timeout=IDLE_TIMEOUT)


def _redis_produce(key: str, n: int, batch: int, body_size: int) -> tuple[float, int]:
    r = _redis_client()
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


def _redis_consume(key: str, group: str, n: int, batch: int) -> tuple[float, int]:
    r = _redis_client()
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


def _redis_once(n: int, batch: int, body_size: int) -> tuple[float, float]:
    r = _redis_client()
    key = f"onceq-peer-{uuid.uuid4().hex[:12]}"
    group = "bench"
    try:
        r.xgroup_create(key, group, id="0", mkstream=True)
        prod, _ = _run_child("redis_produce", (key, n, batch, body_size), n)
        stored = r.xlen(key)
        if stored != n:
            raise RuntimeError(f"redis stream holds {stored} entries, expected {n}")
        cons, got = _run_child("redis_consume", (key, group, n, batch), n)
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


_RUNNERS = {"redis": _redis_once, "nats": _nats_once}


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
        results[peer] = entry
    return results


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
