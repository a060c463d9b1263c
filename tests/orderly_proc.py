"""An orderly push consumer in its own process, for tests that kill, stop or start members.

Messages carry ``<key> <sequence number>`` as body. Every handled message appends
``<monotonic ns> <key> <seq>`` as one line to ``--out``, written before the listener
returns, so a parent that SIGKILLs this process still sees what was handled (CLOCK_MONOTONIC
is one clock for every process of the machine: lines of several files merge in time order).
SIGTERM shuts the consumer down gracefully (commit, unlock, unregister) and exits 0.
Prints ``READY <client id>`` once started and ``DONE`` after a graceful shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

from onceq.client.consume import orderly
from onceq.client.push import PushConsumer


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--client-id", required=True)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args(argv)
    fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    @orderly
    async def listener(msgs, ctx):
        now = time.monotonic_ns()
        os.write(fd, b"".join(b"%d %s\n" % (now, m.body) for m in msgs))

    consumer = PushConsumer(args.addr, args.group, listener, client_id=args.client_id,
                            consume_from="FIRST", rebalance_interval_s=2.0,
                            heartbeat_interval_s=1.0, batch_size=args.batch,
                            commit_interval_s=1.0)
    consumer.subscribe(args.topic, "*")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await consumer.start()
    print(f"READY {consumer.client_id}", flush=True)
    await stop.wait()
    await consumer.shutdown()
    os.close(fd)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
