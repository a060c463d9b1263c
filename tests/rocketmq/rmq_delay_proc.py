"""The official RocketMQ 5 Python client sending delayed messages to an onceq broker's
gRPC endpoint, in a process of its own (as ``rmq_proc.py``, whose helpers it uses).

    python rmq_delay_proc.py ENDPOINT COMMAND JSON_ARGS

prints one JSON object on its last stdout line. Commands: ``produce_delayed`` (messages
with a ``delivery_timestamp`` ``delay_s`` seconds ahead, whole seconds as the client takes
it: each one's receipt, or its error); ``receive`` (a SimpleConsumer of ``group``: the
messages it receives within ``wait_s``, each with its type, delivery timestamp and the
time it arrived).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from rmq_proc import config, tls  # the same directory: this script's own
from rocketmq import FilterExpression, Message, Producer, SimpleConsumer


def produce_delayed(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    producer = Producer(config(endpoint, args), (args["topic"],), tls_enable=tls(args))
    producer.startup()
    try:
        out = []
        for m in args["messages"]:
            msg = Message()
            msg.topic = args["topic"]
            msg.body = m["body"].encode()
            for k, v in m.get("props", {}).items():
                msg.add_property(k, v)
            at = int(time.time()) + m["delay_s"]
            msg.delivery_timestamp = at
            try:
                receipt = producer.send(msg)
            except Exception as exc:
                out.append({"error": str(exc), "type": type(exc).__name__})
                continue
            out.append({"message_id": receipt.message_id, "offset": receipt.offset,
                        "deliver_at_s": at, "sent_at": time.time()})
        return {"sent": out}
    finally:
        producer.shutdown()


def receive(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    consumer = SimpleConsumer(config(endpoint, args), args["group"],
                              {args["topic"]: FilterExpression()}, tls_enable=tls(args))
    consumer.startup()
    try:
        got: list[dict[str, Any]] = []
        deadline = time.time() + args["wait_s"]
        while len(got) < args["count"] and time.time() < deadline:
            for m in consumer.receive(16, 10):
                got.append({"body": m.body.decode(), "message_id": m.message_id,
                            "delivery_timestamp": m.delivery_timestamp,
                            "properties": dict(m.properties or {}),
                            "received_at": time.time()})
                consumer.ack(m)
        return {"received": got}
    finally:
        consumer.shutdown()


def main() -> None:
    endpoint, command, raw = sys.argv[1], sys.argv[2], sys.argv[3]
    fn = {"produce_delayed": produce_delayed, "receive": receive}[command]
    print(json.dumps(fn(endpoint, json.loads(raw))), flush=True)


if __name__ == "__main__":
    main()
