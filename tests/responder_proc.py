"""A request-reply responder in its own process, for tests that kill it mid-request.

It consumes ``--topic`` in ``--group`` (one listener call at a time, one message a call)
with the idempotency layer on the SQLite store ``--store`` keyed by the messages' business
key. Its business effect is a row ``(key, pid)`` in the table ``effects`` of the SQLite file
``--effects``; its reply is ``<body>|<pid>|<random>``, so a reply made twice for one key
would differ. The first process to be handed the request with body ``HANG`` (the marker
file ``--hang-marker`` decides which) prints ``IN-HANDLER`` and hangs before its effect,
for the parent to SIGKILL. Prints ``READY <client id>``; SIGTERM shuts it down gracefully,
then it prints ``DONE`` and its counters as JSON (the guard's and the consumer's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sqlite3
import sys
import time

from onceq.client.push import PushConsumer
from onceq.client.responder import responder
from onceq.idempotency import idempotent


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--effects", required=True)
    ap.add_argument("--hang-marker", required=True)
    ap.add_argument("--lease", type=float, default=1.0)
    args = ap.parse_args(argv)

    db = sqlite3.connect(args.effects, isolation_level=None, check_same_thread=False,
                         timeout=30)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE IF NOT EXISTS effects (key TEXT NOT NULL, pid INTEGER NOT NULL)")

    def handle(m):  # a plain function: runs on a thread
        if m.body == b"HANG":
            try:
                os.close(os.open(args.hang_marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass  # another process hung on it already: this one answers
            else:
                print("IN-HANDLER", flush=True)
                time.sleep(3600)
        db.execute("INSERT INTO effects VALUES (?, ?)", (m.keys, os.getpid()))
        return b"|".join([m.body, str(os.getpid()).encode(), os.urandom(4).hex().encode()])

    listener = idempotent(responder(handle), store=args.store, key="keys",
                          lease_s=args.lease)
    consumer = PushConsumer(args.addr, args.group, listener, consume_from="FIRST",
                            concurrency=1, batch_size=1, rebalance_interval_s=1.0,
                            heartbeat_interval_s=1.0, commit_interval_s=3600.0)
    consumer.subscribe(args.topic, "*")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await consumer.start()
    print(f"READY {consumer.client_id}", flush=True)
    await stop.wait()
    await consumer.shutdown()
    print("DONE " + json.dumps({"guard": listener.stats, "consumer": consumer.stats}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
