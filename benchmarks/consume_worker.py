"""A consumer process of benchmarks/consume.py.

mode ``push``: a PushConsumer (listener batch 32, pull batch 32) with a no-op listener;
optional arguments after ``name``: the listener batch, the listener kind (``async`` or
``plain``, a function run on the consumer's threads) and the consumer group.
mode ``pull``: the raw pull consumer, one prefetching stream per queue (pull batch 32).
Every 50 ms it writes "<count> <time of the last message> <time of the first>" to ``out``;
SIGTERM stops it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time

from _progress import note


async def main(mode: str, addr: str, topic: str, queues: int, out: str, name: str,
               batch: int = 32, kind: str = "async", group: str = "bench-push") -> None:
    count = 0
    last = first = 0.0
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def report() -> None:
        while True:
            tmp = f"{out}.tmp"
            with open(tmp, "w") as f:
                f.write(f"{count} {last} {first}")
            os.replace(tmp, out)
            await asyncio.sleep(0.05)

    reporter = asyncio.create_task(report())
    if mode == "push":
        from onceq.client.push import PushConsumer

        async def listener(msgs, ctx):
            nonlocal count, last, first
            count += len(msgs)
            last = time.time()
            first = first or last

        lock = threading.Lock()

        def plain(msgs, ctx):  # on the consumer's threads: the count needs the lock
            nonlocal count, last, first
            with lock:
                count += len(msgs)
                last = time.time()
                first = first or last

        c = PushConsumer(addr, group, listener if kind == "async" else plain,
                         consume_from="FIRST", batch_size=batch, pull_batch_size=32,
                         instance_name=name)
        c.subscribe(topic)
        await c.start()
        note(f"{name}: push consumer on {topic} started")
        print("ready", flush=True)
        await stop.wait()
        await c.shutdown()
    else:
        from onceq import PullConsumer

        async with PullConsumer(addr, "bench-pull") as pc:
            async def one(q: int) -> None:
                nonlocal count, last, first
                async for r in pc.stream(topic, q, 0, 32, suspend=1.0):
                    count += len(r.messages)
                    if r.messages:
                        last = time.time()
                        first = first or last

            tasks = [asyncio.create_task(one(q)) for q in range(queues)]
            note(f"{name}: pulling {queues} queues of {topic}")
            print("ready", flush=True)
            await stop.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    reporter.cancel()
    note(f"{name}: stopped after {count} messages")


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    a = sys.argv[1:]
    opt = a[6:]
    asyncio.run(main(a[0], a[1], a[2], int(a[3]), a[4], a[5], *([int(opt[0])] if opt else []),
                     *opt[1:]))
