"""A fuzz campaign against a broker process: millions of frames, well-formed and not.

A broker runs in its own process (``onceq broker start``). A canary topic is filled with
known messages first. Then ``--conns`` connections send ``--frames`` frames in all, in
pipelined chunks, each frame one of:

* a request of a random known code whose header follows the request's typed fields
  (``protocol/requests.py``) with values that are sometimes right, sometimes of the wrong
  type, out of range (2^63, 2^64, -1, 65535...), missing, or extra; names drawn from a small
  pool (so requests meet real topics, groups and clients) and from the system topics;
  payloads a valid batch of messages or junk;
* such a frame with bytes flipped, cut short or grown (the connection then ends with it and
  a new one is opened, so that every frame sent is read by the broker);
* a request of an unknown code, a frame of another kind or version, or junk bytes.

A connection the broker closes (a stream it cannot frame) is opened again. Throughout, one
more connection pings every 20 ms and records the latency. At the end: the broker process
must be alive and answer, ``SYSTEM_ERROR`` answers (internal errors) and logged tracebacks
are counted (goal 0 for both), the canary topic must read back intact, then after a clean
stop ``onceq broker verify`` must find no damage and a restarted broker must serve the
canary again.

Usage: python benchmarks/fuzz.py [--frames 5000000] [--conns 4] [--seed 1] [--flush async]
Prints one JSON document; exits 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _progress import Count, note  # noqa: E402
from throughput import start_broker  # noqa: E402

from onceq import Admin, Producer, PullConsumer  # noqa: E402
from onceq.log.record import encode_part  # noqa: E402
from onceq.protocol import requests as rq  # noqa: E402
from onceq.protocol import schema  # noqa: E402
from onceq.protocol.codes import RequestCode  # noqa: E402
from onceq.protocol.errors import ErrorCode  # noqa: E402
from onceq.protocol.frame import (  # noqa: E402
    PROTOCOL_VERSION,
    PUSH,
    REQUEST,
    RESPONSE,
    FrameDecoder,
    encode_frame,
)

CANARY, CANARY_N, CANARY_QUEUES = "canary-keep", 1000, 4
NAMES = ["f0", "f1", "f2", "g0", "g1", "c0", "c1", "%SCHEDULE%", "%RETRY%g0", "%DLQ%g0",
         "%TRACE%", "%OFFSETS%", "", "x" * 300, "a/b", "ü"]
INTS = [0, 1, 2, 3, 7, -1, -2, 255, 256, 65535, 65536, 2 ** 31, 2 ** 32, 2 ** 62 - 1,
        2 ** 62, 2 ** 63 - 1, -(2 ** 63), 2 ** 64 - 1, 10 ** 12, 1_700_000_000_000]
_U32 = struct.Struct("<I")
CODES = [int(c) for c in RequestCode]


class Gen:
    """Random frames from a seeded generator (the same seed, the same campaign)."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    def scalar(self) -> Any:
        r = self.r
        return r.choice([lambda: r.choice(INTS), lambda: r.choice(NAMES), lambda: None,
                         lambda: r.random() < 0.5, lambda: r.random() * 1e6,
                         lambda: r.randbytes(r.randrange(8)), lambda: []])()

    def value(self, spec: schema.Spec) -> Any:
        r = self.r
        if r.random() < 0.15:
            return self.junk(2)
        parse = spec.parse
        if parse is schema.p_int or parse in (rq.p_offset, rq.p_gen, rq.p_seq):
            return r.choice(INTS)
        if parse is schema.p_str:
            return r.choice(NAMES)
        if parse is schema.p_bool:
            return r.random() < 0.5
        if parse is schema.p_str_list:
            return [r.choice(NAMES) for _ in range(r.randrange(4))]
        if parse is schema.p_int_list:
            return [r.choice(INTS) for _ in range(r.randrange(4))]
        if parse in (schema.p_str_map, schema.p_map):
            return {r.choice(NAMES): r.choice(NAMES) for _ in range(r.randrange(3))}
        if parse is rq.p_groups:
            return [{"group": r.choice(NAMES),
                     "subs": {r.choice(NAMES): r.choice(["*", "a||b", ""])},
                     "model": r.choice(["CLUSTERING", "BROADCASTING", "X"]),
                     "held": [[r.choice(NAMES), r.choice(INTS), r.choice(INTS)]]
                     if r.random() < 0.3 else None,
                     "reset_gen": r.choice(INTS)} for _ in range(r.randrange(3))]
        # queue refs, offsets lists and the like: lists of small lists
        return [[r.choice(NAMES), r.choice(INTS), r.choice(INTS)][: r.randrange(1, 4)]
                for _ in range(r.randrange(4))]

    def junk(self, depth: int) -> Any:
        r = self.r
        if depth <= 0 or r.random() < 0.6:
            return self.scalar()
        if r.random() < 0.5:
            return [self.junk(depth - 1) for _ in range(r.randrange(4))]
        return {str(self.scalar()): self.junk(depth - 1) for _ in range(r.randrange(3))}

    def payload(self) -> bytes:
        r = self.r
        if r.random() < 0.7:
            parts = [encode_part(r.randbytes(r.randrange(64)), f"K{r.randrange(10 ** 6)}",
                                 r.choice([1_700_000_000_000, 0, 2 ** 62]),
                                 tags=r.choice(["", "a", "b"]),
                                 properties={"DELIVER_AT_MS": r.choice(["x", "1", str(2 ** 70)]),
                                             "REAL_TOPIC": r.choice(NAMES)}
                                 if r.random() < 0.2 else None,
                                 reconsume_times=r.choice([0, 1, 65535]))
                     for _ in range(r.randrange(1, 4))]
            data = b"".join(_U32.pack(len(p)) + p for p in parts)
            if r.random() < 0.2:  # a damaged batch
                i = r.randrange(len(data))
                data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
            return data
        return r.randbytes(r.randrange(256))

    def request(self, corr: int) -> tuple[bytes, bool, bool]:
        """One frame, whether the stream stays well framed, and whether the broker answers
        it at once (a held pull answers within ``long_poll_max_s``: not waited for)."""
        r = self.r
        roll = r.random()
        if roll < 0.04:  # an unknown code, or a frame of another kind (ignored, unanswered)
            kind = r.choice([REQUEST, REQUEST, RESPONSE, PUSH])
            return encode_frame(kind, r.choice([0, 2, 99, 65535]), corr,
                                {"topic": r.choice(NAMES)}), True, kind == REQUEST
        code = r.choice(CODES)
        cls = rq.REQUESTS[code]
        answered = code != RequestCode.PULL
        header: dict[Any, Any] = {}
        for spec in cls.SPECS:
            if r.random() < 0.9:
                header[spec.wire] = self.value(spec)
        if r.random() < 0.1:
            key = self.scalar() if r.random() < 0.3 else "extra"
            header[key if isinstance(key, str | int | bool | None) else "extra"] = self.junk(2)
        payload = self.payload() if cls.HAS_PAYLOAD or r.random() < 0.05 else b""
        try:
            frame = encode_frame(REQUEST, code, corr, header, payload)
        except (TypeError, ValueError, OverflowError):  # msgpack cannot carry the value
            frame = encode_frame(REQUEST, code, corr, {}, payload)
        if roll < 0.05:  # bytes flipped, cut or grown: the stream may break from here
            b = bytearray(frame)
            for _ in range(r.randrange(1, 4)):
                b[r.randrange(len(b))] = r.randrange(256)
            if r.random() < 0.3:
                b = b[: r.randrange(len(b))] + r.randbytes(r.randrange(32))
            return bytes(b), False, False
        if roll < 0.055:  # a version the broker does not speak
            b = bytearray(frame)
            b[4] = (PROTOCOL_VERSION + 1 + r.randrange(200)) % 256
            return bytes(b), False, False
        return frame, True, answered


class Tally:
    def __init__(self) -> None:
        self.sent = 0
        self.answers: dict[int, int] = {}
        self.closed_by_broker = 0
        self.unanswered = 0

    def answer(self, code: int) -> None:
        self.answers[code] = self.answers.get(code, 0) + 1


async def fuzz_conn(addr: str, gen: Gen, frames: int, chunk: int, tally: Tally,
                    count: Count) -> None:
    host, port = addr.rsplit(":", 1)
    left = frames
    while left > 0:
        reader, writer = await asyncio.open_connection(host, int(port))
        decoder = FrameDecoder()
        try:
            while left > 0:
                # up to ``chunk`` frames; one that breaks the framing ends the chunk (the
                # broker reads every frame sent, then closes the stream it cannot frame)
                out, framed, expect = [], True, 0
                while framed and len(out) < min(chunk, left):
                    frame, framed, answered = gen.request(len(out) + 1)
                    out.append(frame)
                    expect += answered
                n = len(out)
                writer.write(b"".join(out))
                left -= n
                tally.sent += n
                count.add(n)
                got = 0
                broken = not framed
                try:
                    while got < expect:
                        data = await asyncio.wait_for(reader.read(1 << 16), 10 if not broken
                                                      else 1.0)
                        if not data:
                            raise ConnectionResetError
                        decoder.feed(data)
                        for _v, kind, code, corr, _h, _p in decoder.frames():
                            if kind == RESPONSE:
                                tally.answer(code)
                                got += corr != 0  # 0: about the connection, not a request
                except TimeoutError:
                    if not broken:
                        raise RuntimeError(f"{expect - got} well-formed requests were not "
                                           "answered within 10 s") from None
                tally.unanswered += expect - got
                if broken:  # the stream is out of step: start a new connection
                    break
        except (ConnectionResetError, BrokenPipeError, asyncio.IncompleteReadError):
            tally.closed_by_broker += 1
        finally:
            writer.close()


async def pinger(addr: str, stop: asyncio.Event, latencies: list[float]) -> None:
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    decoder = FrameDecoder()
    corr = 0
    try:
        while not stop.is_set():
            corr += 1
            t0 = time.perf_counter()
            writer.write(encode_frame(REQUEST, RequestCode.PING, corr))
            answered = False
            while not answered:
                data = await reader.read(1 << 16)
                if not data:
                    raise RuntimeError("the broker closed the ping connection")
                decoder.feed(data)
                answered = any(c == corr for _v, _k, _code, c, _h, _p in decoder.frames())
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)
    finally:
        writer.close()


async def fill_canary(addr: str) -> list[bytes]:
    async with Admin(addr) as admin:
        await admin.create_topic(CANARY, CANARY_QUEUES)
        for name in ("f0", "f1", "f2"):
            await admin.create_topic(name, 2)
    bodies = [f"canary-{i}".encode() for i in range(CANARY_N)]
    async with Producer(addr) as p:
        for i in range(0, CANARY_N, 100):
            await p.send_batch(CANARY, bodies[i:i + 100], queue=0)
    return bodies


async def read_canary(addr: str) -> list[bytes]:
    out: list[bytes] = []
    async with PullConsumer(addr, "canary-reader") as c:
        offset = 0
        while len(out) < CANARY_N:
            r = await c.pull(CANARY, 0, offset, 256)
            if not r.messages:
                break
            out.extend(m.body for m in r.messages)
            offset = r.next_offset
    return out


async def campaign(addr: str, frames: int, conns: int, seed: int) -> dict[str, Any]:
    tally = Tally()
    latencies: list[float] = []
    stop = asyncio.Event()
    ping = asyncio.create_task(pinger(addr, stop, latencies))
    count = Count("frames", frames)
    t0 = time.monotonic()
    per = frames // conns
    await asyncio.gather(*(fuzz_conn(addr, Gen(seed * 1000 + i), per + (i < frames % conns),
                                     200, tally, count) for i in range(conns)))
    took = time.monotonic() - t0
    stop.set()
    await ping
    count.done()
    lat = sorted(latencies)
    return {
        "frames": tally.sent, "seconds": round(took, 1),
        "frames_per_s": round(tally.sent / took),
        "answered": sum(tally.answers.values()),
        "answers": {(ErrorCode(c).name if c in ErrorCode._value2member_map_ else str(c)): n
                    for c, n in sorted(tally.answers.items())},
        "system_errors": tally.answers.get(int(ErrorCode.SYSTEM_ERROR), 0),
        "connections_closed_by_broker": tally.closed_by_broker,
        "ping": {"count": len(lat), "p50_ms": round(1000 * statistics.median(lat), 2),
                 "p99_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 2),
                 "max_ms": round(1000 * lat[-1], 2)},
    }


def traceback_kinds(log: str, most: int = 10) -> dict[str, int]:
    """The tracebacks in a broker log by kind (the last frame's place and the error)."""
    kinds: dict[str, int] = {}
    for block in log.split("Traceback (most recent call last):")[1:]:
        lines = [x for x in block.splitlines() if x.strip()]
        where = [x.strip() for x in lines if x.strip().startswith('File "')]
        error = next((x for x in lines if not x.startswith(" ")), "?")
        key = f"{where[-1] if where else '?'}: {error}"[:300]
        kinds[key] = kinds.get(key, 0) + 1
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:most])


def error_lines(log: str, most: int = 10) -> dict[str, int]:
    """The broker's ERROR lines by message (numbers and names masked), most frequent first."""
    kinds: dict[str, int] = {}
    for line in log.splitlines():
        if " ERROR " in line:
            key = re.sub(r"\d+", "N", line.split(" ERROR ", 1)[1])[:200]
            kinds[key] = kinds.get(key, 0) + 1
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:most])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=5_000_000)
    ap.add_argument("--conns", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--flush", default="async", choices=["async", "sync"])
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="onceq-fuzz-") as d:
        data = os.path.join(d, "data")
        broker, addr = start_broker(data, a.flush)
        try:
            bodies = asyncio.run(fill_canary(addr))
            note(f"canary: {CANARY_N} messages; fuzzing with {a.frames} frames")
            report = asyncio.run(campaign(addr, a.frames, a.conns, a.seed))
            report["broker_alive"] = broker.poll() is None
            report["canary_intact_live"] = asyncio.run(read_canary(addr)) == bodies
        finally:
            broker.send_signal(signal.SIGTERM)
            broker.wait(timeout=120)
        with open(os.path.join(data, "broker.err")) as f:
            log = f.read()
        report["tracebacks_logged"] = log.count("Traceback")
        report["traceback_kinds"] = traceback_kinds(log)
        report["error_lines"] = error_lines(log)
        report["broker_exit_code"] = broker.returncode
        verify = subprocess.run([sys.executable, "-m", "onceq.cli.main", "broker", "verify",
                                 "--data-dir", data], capture_output=True, text=True)
        report["verify_exit_code"] = verify.returncode
        broker, addr = start_broker(data, a.flush)
        try:
            report["canary_intact_after_restart"] = asyncio.run(read_canary(addr)) == bodies
        finally:
            broker.send_signal(signal.SIGTERM)
            broker.wait(timeout=120)
    report["goals"] = goals = {
        "no crash": report["broker_alive"] and report["broker_exit_code"] == 0,
        "no internal error": report["system_errors"] == 0 and report["tracebacks_logged"] == 0,
        "ping p99 < 100 ms": report["ping"]["p99_ms"] < 100,
        "data intact": report["canary_intact_live"] and report["canary_intact_after_restart"]
        and report["verify_exit_code"] == 0,
    }
    print(json.dumps(report, indent=1))
    sys.exit(0 if all(goals.values()) else 1)


if __name__ == "__main__":
    main()
