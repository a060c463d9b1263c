"""A push consumer in its own process, for tests that kill, stop or restart a member.

Every handled message appends ``<unique key> <reconsume times>`` as one line to ``--out``,
flushed per message, so a parent that SIGKILLs this process still sees what was handled.
SIGTERM/SIGINT shut the consumer down gracefully (commit offsets, unregister) and exit 0.
Prints ``READY <client id>`` once started and ``DONE`` after a graceful shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from onceq.client.push import PushConsumer


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="CLUSTERING")
    ap.add_argument("--consume-from", default="FIRST")
    ap.add_argument("--instance", default="DEFAULT")
    ap.add_argument("--offset-dir", default=None)
    ap.add_argument("--rebalance-interval", type=float, default=20.0)
    ap.add_argument("--heartbeat-interval", type=float, default=10.0)
    args = ap.parse_args(argv)

    out = open(args.out, "a", buffering=1)  # noqa: SIM115 - open for the process lifetime

    async def listener(msgs, ctx):
        for m in msgs:
            out.write(f"{m.unique_key} {m.reconsume_times}\n")
            out.flush()

    consumer = PushConsumer(
        args.addr, args.group, listener, model=args.model, consume_from=args.consume_from,
        instance_name=args.instance, offset_dir=args.offset_dir,
        rebalance_interval_s=args.rebalance_interval,
        heartbeat_interval_s=args.heartbeat_interval,
    )
    consumer.subscribe(args.topic, "*")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await consumer.start()
    print(f"READY {consumer.client_id}", flush=True)
    await stop.wait()
    await consumer.shutdown()
    out.close()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
