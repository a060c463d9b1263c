"""One consumer process of the rebalance-storm benchmark (see rebalance_storm.py).

Consumes with a PushConsumer, sleeps ``handler_ms`` per message, and appends each delivered
unique key to ``out`` (flushed per batch, so a SIGKILL loses at most what was in flight).
SIGTERM shuts it down gracefully and writes the consumer's counters to ``out.stats``.
A broker restart needs nothing here: the consumer reconnects, re-asserts the queues it holds
and sends the offsets of finished work again before it pulls.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time

from _progress import note

from onceq.client.push import PushConsumer


async def main(addr: str, group: str, topic: str, name: str, out: str, lock: bool,
               handler_ms: float) -> None:
    f = open(out, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    async def listener(msgs, ctx):
        await asyncio.sleep(handler_ms / 1000)
        now = time.time()
        f.write("".join(f"{m.unique_key} {now:.6f} {m.topic}:{m.queue_id}:{m.queue_offset}\n"
                        for m in msgs))

    c = PushConsumer(addr, group, listener, consume_from="FIRST", access_lock=lock,
                     instance_name=name, rebalance_interval_s=5, pull_suspend_s=2)
    c.subscribe(topic)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await c.start()
    note(f"{name}: consuming {topic} in group {group} (access lock {'on' if lock else 'off'})")
    print("ready", flush=True)
    await stop.wait()
    await c.shutdown()
    note(f"{name}: stopped")
    f.close()
    with open(out + ".stats", "w") as fh:
        json.dump(dict(c.stats), fh)


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(a[0], a[1], a[2], a[3], a[4], a[5] == "1", float(a[6])))
