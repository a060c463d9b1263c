"""Request-reply round trips: onceq next to a plain asyncio TCP echo and NATS request-reply.

Systems, all on loopback, each server and responder in a process of its own and the
requester in this one (one event loop each, uvloop when installed, in every process):

* ``tcp_echo``: an asyncio server answering each length-prefixed frame with the same bytes
  on one connection: the floor of any request-reply over TCP with asyncio.
* ``onceq``: a broker (``onceq broker start``, async flush), a responder (``PushConsumer``
  with ``responder(...)`` answering each request with its body), ``Producer.request``. A
  request is a durable message (stored, then pulled by the responder); the reply is pushed
  by the broker to the requester's connection.
* ``nats``: the NATS server on 127.0.0.1:4222 (core NATS, not JetStream: nothing stored), a
  responder subscribed with ``msg.respond``, ``nc.request``. Reported as unavailable when
  nats-py or the server is missing.

Two loads per system, each for ``--seconds`` after a warm-up of 200 round trips: ``serial``
(one request in flight: the round trip's latency) and ``concurrent`` (``--in-flight``
requests in flight: the round trips per second the system sustains). Bodies of 100 bytes.
Reported: round trips per second, p50 / p99 latency in ms, and the ratios of onceq to the
two others (round trips per second: onceq / other; latency: onceq / other).

Usage: python benchmarks/request_reply.py [--seconds 3] [--in-flight 32]
           [--systems tcp_echo,onceq,nats]
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

BODY = b"x" * 100
WARMUP = 200
NATS_URL = "nats://127.0.0.1:4222"
SUBJECT = "onceq.bench.rr"
TOPIC = "rr-bench"
_LEN = struct.Struct("<I")

Ask = Callable[[bytes], Awaitable[bytes]]


def _uvloop() -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{what} did not start")


def _child(role: str, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    """This script in another process, as ``role``, once it printed ``READY [detail]``:
    the process and the detail."""
    proc = subprocess.Popen([sys.executable, __file__, "--child", role, *args],
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("READY"):
        proc.kill()
        raise RuntimeError(f"{role} did not start: {line!r}")
    return proc, line[len("READY"):].strip()


# ---------------------------------------------------------------- the measurement
def _summary(latencies: list[float], elapsed: float) -> dict[str, Any]:
    ordered = sorted(latencies)
    n = len(ordered)
    return {"round_trips": n, "rt_per_s": round(n / elapsed, 1),
            "p50_ms": round(ordered[n // 2] * 1000, 3),
            "p99_ms": round(ordered[min(int(n * 0.99), n - 1)] * 1000, 3)}


async def _measure(ask: Ask, seconds: float, in_flight: int) -> dict[str, Any]:
    for _ in range(WARMUP):
        assert await ask(BODY) == BODY
    latencies: list[float] = []
    clock = time.perf_counter
    end = clock() + seconds

    async def worker() -> None:
        while clock() < end:
            t0 = clock()
            reply = await ask(BODY)
            latencies.append(clock() - t0)
            if reply != BODY:
                raise AssertionError(f"wrong reply: {reply[:40]!r}")

    t0 = clock()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return _summary(latencies, clock() - t0)


async def _both(ask: Ask, seconds: float, in_flight: int) -> dict[str, Any]:
    return {"serial": await _measure(ask, seconds, 1),
            "concurrent": await _measure(ask, seconds, in_flight)}


# ---------------------------------------------------------------- tcp echo
async def _echo_serve() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readexactly(4)
                writer.write(head + await reader.readexactly(_LEN.unpack(head)[0]))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


async def _tcp_echo(seconds: float, in_flight: int) -> dict[str, Any]:
    proc, port = _child("echo")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        waiting: list[asyncio.Future[bytes]] = []

        async def read_loop() -> None:
            while True:
                head = await reader.readexactly(4)
                body = await reader.readexactly(_LEN.unpack(head)[0])
                waiting.pop(0).set_result(body)

        reading = asyncio.create_task(read_loop())

        async def ask(body: bytes) -> bytes:
            fut = asyncio.get_running_loop().create_future()
            waiting.append(fut)  # answers come in order on one connection
            writer.write(_LEN.pack(len(body)) + body)
            return await fut

        try:
            return await _both(ask, seconds, in_flight)
        finally:
            reading.cancel()
            writer.close()
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- onceq
async def _responder(addr: str) -> None:
    from onceq import PushConsumer
    from onceq.client.responder import responder

    async def echo(m: Any) -> bytes:
        return bytes(m.body)

    c = PushConsumer(addr, "rr-bench", responder(echo), consume_from="FIRST")
    c.subscribe(TOPIC)
    await c.start()
    print("READY", flush=True)
    await asyncio.Event().wait()


async def _onceq(seconds: float, in_flight: int) -> dict[str, Any]:
    from onceq import Admin, Producer

    with tempfile.TemporaryDirectory() as data:
        port = _free_port()
        broker = subprocess.Popen(
            [sys.executable, "-m", "onceq.cli.main", "broker", "start", "--data-dir", data,
             "--port", str(port), "--log-level", "WARNING"], stdout=subprocess.DEVNULL)
        responder = None
        try:
            _wait_port(port, broker, "broker")
            addr = f"127.0.0.1:{port}"
            async with Admin(addr) as admin:
                await admin.create_topic(TOPIC, 4)
            responder, _ = _child("responder", addr)
            async with Producer(addr) as p:
                async def ask(body: bytes) -> bytes:
                    return (await p.request(TOPIC, body, timeout=30)).body

                out = await _both(ask, seconds, in_flight)
                out["client_stats"] = {k: v for k, v in p.requests.stats.items()
                                       if isinstance(v, int)}
                return out
        finally:
            for proc in (responder, broker):
                if proc is not None:
                    proc.terminate()
                    proc.wait(10)


# ---------------------------------------------------------------- nats
async def _nats_responder() -> None:
    import nats

    nc = await nats.connect(NATS_URL)

    async def echo(msg: Any) -> None:
        await msg.respond(msg.data)

    await nc.subscribe(SUBJECT, cb=echo)
    await nc.flush()
    print("READY", flush=True)
    await asyncio.Event().wait()


async def _nats(seconds: float, in_flight: int) -> dict[str, Any]:
    try:
        import nats
        with socket.create_connection(("127.0.0.1", 4222), timeout=1):
            pass
    except (ImportError, OSError) as exc:
        return {"unavailable": str(exc)}
    responder, _ = _child("nats-responder")
    try:
        nc = await nats.connect(NATS_URL)
        try:
            async def ask(body: bytes) -> bytes:
                reply = await nc.request(SUBJECT, body, timeout=30)
                return reply.data  # type: ignore[no-any-return]

            return await _both(ask, seconds, in_flight)
        finally:
            await nc.close()
    finally:
        responder.terminate()
        responder.wait(10)


# ---------------------------------------------------------------- main
def _ratios(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mine = results.get("onceq", {})
    for other in ("tcp_echo", "nats"):
        theirs = results.get(other, {})
        if "serial" not in mine or "serial" not in theirs:
            continue
        for load in ("serial", "concurrent"):
            a, b = mine[load], theirs[load]
            out[f"onceq_vs_{other}_{load}"] = {
                "rt_per_s": round(a["rt_per_s"] / b["rt_per_s"], 3),
                "p50_latency": round(a["p50_ms"] / b["p50_ms"], 2),
                "p99_latency": round(a["p99_ms"] / b["p99_ms"], 2)}
    return out


async def run(systems: list[str], seconds: float, in_flight: int) -> dict[str, Any]:
    fns = {"tcp_echo": _tcp_echo, "onceq": _onceq, "nats": _nats}
    results = {s: await fns[s](seconds, in_flight) for s in systems}
    return {"body_bytes": len(BODY), "seconds": seconds, "in_flight": in_flight,
            "cpus": os.cpu_count(), "results": results, "ratios": _ratios(results)}


def child_main(role: str, args: list[str]) -> None:
    _uvloop()
    if role == "echo":
        asyncio.run(_echo_serve())
    elif role == "responder":
        asyncio.run(_responder(args[0]))
    else:
        asyncio.run(_nats_responder())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--in-flight", type=int, default=32)
    ap.add_argument("--systems", default="tcp_echo,onceq,nats")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.child:
        child_main(args.child, rest)
        return
    _uvloop()
    systems = [s for s in args.systems.split(",") if s]
    print(json.dumps(asyncio.run(run(systems, args.seconds, args.in_flight)), indent=2))


if __name__ == "__main__":
    main()
