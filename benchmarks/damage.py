"""What one flipped byte costs, seen by a user with the public API and CLI only.

2,000 acknowledged sends (4 queues, about 300-byte messages) over about 10 commit-log
segments of 64 KiB, the broker stopped, one byte flipped in the middle of the 2nd segment,
the broker restarted: count the acknowledged messages still readable at their offset. Then
create a new topic, send 100 messages, restart cleanly and count them.

``--src`` runs other source trees too (e.g. a ``git worktree`` of an older commit).
Usage: python benchmarks/damage.py [--src DIR ...]; prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
sys.path.insert(0, HERE)

from _progress import Steps, note  # noqa: E402

N = 2000
QUEUES = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(src: str, data: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceq.cli.main", "broker", "start", "--data-dir", data,
         "--port", str(port), "--segment-size", "65536", "--max-body", "8192",
         "--log-level", "ERROR"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": src})
    while True:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode()[-2000:])
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.02)


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    return err.decode()


async def send(addr: str, topic: str, n: int) -> dict[str, tuple[int, int]]:
    from onceq import Admin, Producer

    async with Admin(addr) as admin:
        await admin.create_topic(topic, QUEUES)
    acked = {}
    async with Producer(addr) as p:
        for i in range(n):
            r = await p.send(topic, f"{topic}-{i:05d}-".encode() + b"x" * 240)
            acked[r.unique_key] = (r.queue_id, r.offset)
    return acked


async def readable(addr: str, topic: str, acked: dict[str, tuple[int, int]]) -> dict:
    from onceq import PullConsumer

    found: dict[str, tuple[int, int]] = {}
    damaged = 0
    async with PullConsumer(addr, "check") as c:
        for q in range(QUEUES):
            off = 0
            while True:
                r = await c.pull(topic, q, off, 64)
                if r.status.name == "DAMAGED":
                    damaged += r.next_offset - off
                elif not r.messages:
                    break
                for m in r.messages:
                    found[m.unique_key] = (m.queue_id, m.queue_offset)
                off = r.next_offset
    ok = sum(1 for k, v in acked.items() if found.get(k) == v)
    return {"acknowledged": len(acked), "readable_at_offset": ok, "lost": len(acked) - ok,
            "pulled_as_damaged": damaged}


def run(src: str) -> dict:
    sys.path.insert(0, src)
    root = tempfile.mkdtemp(prefix="onceq-damage-")
    data = os.path.join(root, "data")
    try:
        note(f"  sending {N} messages to 4 queues")
        proc, addr = start(src, data)
        acked = asyncio.run(send(addr, "orders", N))
        stop(proc)
        segs = sorted(n for n in os.listdir(os.path.join(data, "commitlog")) if n.isdigit())
        seg2 = os.path.join(data, "commitlog", segs[1])
        at = os.path.getsize(seg2) // 2
        with open(seg2, "r+b") as f:
            f.seek(at)
            b = f.read(1)[0]
            f.seek(at)
            f.write(bytes([b ^ 0xFF]))
        note(f"  flipped a byte of segment {segs[1]} at {at}; restarting, reading back")
        proc, addr = start(src, data)
        after_flip = asyncio.run(readable(addr, "orders", acked))
        new_acked = asyncio.run(send(addr, "fresh", 100))
        errors = stop(proc)
        note("  clean restart, reading the new topic")
        proc, addr = start(src, data)
        fresh = asyncio.run(readable(addr, "fresh", new_acked))
        stop(proc)
        return {"segments": len(segs),
                "segments_after": len([n for n in os.listdir(os.path.join(data, "commitlog"))
                                       if n.isdigit()]),
                "after_flip": after_flip, "new_topic_after_clean_restart": fresh,
                "log_lines_at_error_level": len(errors.splitlines())}
    finally:
        shutil.rmtree(root, ignore_errors=True)
        sys.path.remove(src)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", nargs="+", default=[SRC])
    args = ap.parse_args()
    out = {}
    steps = Steps(len(args.src))
    for src in args.src:
        steps.next(f"tree {src}")
        # each tree in its own interpreter: the client modules must come from that tree
        r = subprocess.run([sys.executable, __file__, "--one", src], capture_output=True,
                           text=True, check=False) if len(args.src) > 1 else None
        out[src] = json.loads(r.stdout) if r is not None and r.returncode == 0 else (
            {"error": r.stderr[-2000:]} if r is not None else run(src))
    print(json.dumps({"benchmark": "damage", "messages": N, "queues": QUEUES,
                      "trees": out}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(run(sys.argv[2])))
    else:
        main()
