"""A push consumer in its own process, for tests that kill, stop or restart a member.

Every handled message appends ``<unique key> <reconsume times>`` as one line to ``--out``,
flushed per message, so a parent that SIGKILLs this process still sees what was handled.
SIGTERM/SIGINT shut the consumer down gracefully (commit offsets, unregister) and exit 0.
Prints ``READY <client id>`` once started and ``DONE`` after a graceful shutdown.
``--flow-span N``: pause pulling a queue while its messages in flight span more than N
offsets (so at most N + 1 + one pull's messages past its last commit were handled).
``--pause-at N``: the listener prints ``IN-HANDLER`` when it is handed its N-th message
and then takes ``--pause-sleep`` seconds over it, so that the parent can SIGSTOP this
process inside a listener call.
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
    ap.add_argument("--commit-interval", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=20)
    ap.add_argument("--handler-ms", type=float, default=0.0)
    ap.add_argument("--flow-span", type=int, default=None)
    ap.add_argument("--pause-at", type=int, default=0)
    ap.add_argument("--pause-sleep", type=float, default=1.0)
    args = ap.parse_args(argv)

    out = open(args.out, "a", buffering=1)  # noqa: SIM115 - open for the process lifetime
    handled = 0

    async def listener(msgs, ctx):
        nonlocal handled
        for m in msgs:
            out.write(f"{m.unique_key} {m.reconsume_times}\n")
            out.flush()
            handled += 1
            if handled == args.pause_at:
                print("IN-HANDLER", flush=True)
                await asyncio.sleep(args.pause_sleep)
        if args.handler_ms:
            await asyncio.sleep(args.handler_ms / 1000)

    consumer = PushConsumer(
        args.addr, args.group, listener, model=args.model, consume_from=args.consume_from,
        instance_name=args.instance, offset_dir=args.offset_dir,
        rebalance_interval_s=args.rebalance_interval,
        heartbeat_interval_s=args.heartbeat_interval,
        commit_interval_s=args.commit_interval, concurrency=args.concurrency,
        **({} if args.flow_span is None else {"flow_span": args.flow_span}),
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
