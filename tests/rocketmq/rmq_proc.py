"""The official RocketMQ 5 Python client (``rocketmq-python-client``) driven against an
onceq broker's gRPC endpoint, in a process of its own (its ``rocketmq`` package and its
protocol descriptors cannot share a process with onceq's).

    python rmq_proc.py ENDPOINT COMMAND JSON_ARGS

prints one JSON object on its last stdout line. Commands: ``produce``, ``produce_unknown``,
``resend`` (one SendMessage request sent twice, as a retry after a lost answer),
``simple`` (a SimpleConsumer: receive, change invisible duration, ack, redelivery),
``push`` (a PushConsumer for a while), ``simple_hold`` (a SimpleConsumer
acknowledging with handles received before a broker restart), ``push_live`` (a
PushConsumer until told to stop:
prints ``ready`` once started, appends each message it consumes to a file, shuts down
gracefully at a line on stdin or at SIGTERM), ``signed`` (raw requests with a given
``authorization`` and ``x-mq-date-time``: the broker's answer to each).

Options of every command (in its JSON arguments): ``ak`` and ``sk``, the client's
``Credentials`` (signed requests, for a broker with acl on); ``tls``, the client connects
with TLS, trusting the CA file ``ca`` (gRPC core reads its roots from
``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``: the official client takes no CA of its own).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from rocketmq import (
    ClientConfiguration,
    ConsumeResult,
    Credentials,
    FilterExpression,
    Message,
    MessageListener,
    Producer,
    PushConsumer,
    SimpleConsumer,
)


def config(endpoint: str, args: dict[str, Any] | None = None) -> ClientConfiguration:
    args = args or {}
    creds = Credentials(args["ak"], args["sk"]) if args.get("ak") else Credentials()
    return ClientConfiguration(endpoint, creds, request_timeout=5)


def tls(args: dict[str, Any]) -> bool:
    """Whether the client speaks TLS; the test CA is then gRPC's root of trust."""
    if args.get("ca"):
        os.environ["GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"] = args["ca"]
    return bool(args.get("tls"))


def produce(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    producer = Producer(config(endpoint, args), (args["topic"],), tls_enable=tls(args))
    producer.startup()
    try:
        out = []
        for m in args["messages"]:
            msg = Message()
            msg.topic = args["topic"]
            msg.body = m["body"].encode()
            if m.get("tag"):
                msg.tag = m["tag"]
            for key in m.get("keys", []):
                msg.keys = key  # the setter adds one key
            for k, v in m.get("props", {}).items():
                msg.add_property(k, v)
            if args.get("async"):
                receipt = producer.send_async(msg).result(timeout=10)
            else:
                receipt = producer.send(msg)
            out.append({"message_id": receipt.message_id, "offset": receipt.offset})
        return {"sent": out}
    finally:
        producer.shutdown()


def produce_unknown(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    producer = Producer(config(endpoint, args), tls_enable=tls(args))
    producer.startup()
    try:
        msg = Message()
        msg.topic = args["topic"]
        msg.body = b"x"
        try:
            producer.send(msg)
        except Exception as exc:
            return {"error": str(exc), "type": type(exc).__name__,
                    "code": getattr(exc, "code", None)}
        return {"error": None}
    finally:
        producer.shutdown()


def resend(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    """The request a producer retries after a lost answer: the same message id again."""
    import grpc
    from rocketmq.grpc_protocol import service_pb2, service_pb2_grpc

    req = service_pb2.SendMessageRequest()
    m = req.messages.add()
    m.topic.name = args["topic"]
    m.body = args["body"].encode()
    m.system_properties.message_id = args["message_id"]
    m.system_properties.message_type = 1  # NORMAL
    m.system_properties.born_timestamp.GetCurrentTime()
    md = (("x-mq-client-id", "resend-test"),)
    out = []
    with grpc.insecure_channel(endpoint) as ch:
        stub = service_pb2_grpc.MessagingServiceStub(ch)
        for _ in range(args.get("times", 2)):
            res = stub.SendMessage(req, metadata=md, timeout=5)
            e = res.entries[0]
            out.append({"code": res.status.code, "message_id": e.message_id,
                        "offset": e.offset})
    return {"answers": out}


def signed(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    """A QueryRoute of ``topic`` sent once with each metadata of ``headers`` (a list of
    {name: value}): the status of each answer."""
    import grpc
    from rocketmq.grpc_protocol import service_pb2, service_pb2_grpc

    req = service_pb2.QueryRouteRequest()
    req.topic.name = args["topic"]
    out = []
    with grpc.insecure_channel(endpoint) as ch:
        stub = service_pb2_grpc.MessagingServiceStub(ch)
        for headers in args["headers"]:
            md = (("x-mq-client-id", "signed-test"), *headers.items())
            res = stub.QueryRoute(req, metadata=md, timeout=5)
            out.append({"code": res.status.code, "message": res.status.message})
    return {"answers": out}


def simple(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    """Receive ``n`` messages; acknowledge all but ``leave`` (bodies); change the invisible
    duration of ``change`` (bodies) before acking them; then, with ``redeliver``, receive
    until the messages left come back, and ack those."""
    tags = args.get("tags")
    sub = {args["topic"]: FilterExpression(tags) if tags else FilterExpression()}
    consumer = SimpleConsumer(config(endpoint, args), args["group"], sub,
                              await_duration=args.get("await", 2), tls_enable=tls(args))
    consumer.startup()
    invisible = args.get("invisible", 20)
    leave, change = set(args.get("leave", [])), set(args.get("change", []))
    received: list[dict[str, Any]] = []
    again: list[dict[str, Any]] = []
    t_left: dict[str, float] = {}
    deadline = time.monotonic() + args.get("timeout", 30)
    try:
        while len(received) < args["n"] and time.monotonic() < deadline:
            for m in consumer.receive(args.get("batch", 16), invisible):
                body = m.body.decode()
                received.append({"body": body, "message_id": m.message_id, "tag": m.tag,
                                 "keys": sorted(m.keys), "props": dict(m.properties),
                                 "attempt": m.delivery_attempt, "corrupted": m.corrupted})
                if body in leave:
                    t_left[body] = time.monotonic()
                    continue
                if body in change:
                    consumer.change_invisible_duration(m, invisible)
                consumer.ack(m)
        while args.get("redeliver") and len(again) < len(t_left) and \
                time.monotonic() < deadline:
            for m in consumer.receive(args.get("batch", 16), invisible):
                body = m.body.decode()
                if body in t_left:
                    again.append({"body": body, "attempt": m.delivery_attempt,
                                  "after": time.monotonic() - t_left[body]})
                consumer.ack(m)
        extra = []
        if args.get("drain"):  # nothing else is delivered once everything is acked
            for m in consumer.receive(16, invisible):
                extra.append(m.body.decode())
                consumer.ack(m)
        return {"received": received, "again": again, "extra": extra}
    finally:
        consumer.shutdown()


def push(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    """A PushConsumer that consumes until ``n`` messages were seen or ``timeout``."""
    seen: list[str] = []
    lock = threading.Lock()
    done = threading.Event()

    class Listener(MessageListener):
        def consume(self, message: Message) -> ConsumeResult:
            with lock:
                seen.append(message.body.decode())
                if len(seen) >= args["n"]:
                    done.set()
            return ConsumeResult.SUCCESS

    consumer = PushConsumer(config(endpoint, args), args["group"], Listener(),
                            {args["topic"]: FilterExpression()}, tls_enable=tls(args))
    consumer.startup()
    try:
        done.wait(args.get("timeout", 30))
        time.sleep(args.get("linger", 0))
        with lock:
            return {"seen": list(seen)}
    finally:
        consumer.shutdown()


def push_live(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    """Consume, taking ``handler_ms`` per message, each consumed body appended (and
    flushed) to ``out`` as it is consumed, until a line on stdin or SIGTERM."""
    import signal

    lock = threading.Lock()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    out = open(args["out"], "a", buffering=1)  # noqa: SIM115 (closed below)
    count = [0]

    class Listener(MessageListener):
        def consume(self, message: Message) -> ConsumeResult:
            time.sleep(args.get("handler_ms", 0) / 1000)
            with lock:
                out.write(f"{message.body.decode()} {message.delivery_attempt}\n")
                count[0] += 1
            return ConsumeResult.SUCCESS

    consumer = PushConsumer(config(endpoint, args), args["group"], Listener(),
                            {args["topic"]: FilterExpression()},
                            consumption_thread_count=args.get("threads", 20),
                            tls_enable=tls(args))
    consumer.startup()
    print("ready", flush=True)
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    stop.wait()
    consumer.shutdown()
    with lock:
        out.close()
        return {"consumed": count[0]}


def simple_hold(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    """Receive ``n`` messages; acknowledge those in ``ack_first`` (bodies); print
    ``received`` and wait for a line on stdin (the broker is restarted meanwhile); then
    acknowledge those in ``ack_later`` with the handles received before (retrying while
    the broker is not back) and report each acknowledgement."""
    sub = {args["topic"]: FilterExpression()}
    consumer = SimpleConsumer(config(endpoint, args), args["group"], sub, await_duration=2,
                              tls_enable=tls(args))
    consumer.startup()
    got: dict[str, Any] = {}
    deadline = time.monotonic() + 30
    first, later = set(args.get("ack_first", [])), set(args.get("ack_later", []))
    try:
        while len(got) < args["n"] and time.monotonic() < deadline:
            for m in consumer.receive(16, args.get("invisible", 60)):
                got[m.body.decode()] = m
        for body in sorted(first & set(got)):
            consumer.ack(got[body])
        print("received " + json.dumps(sorted(got)), flush=True)
        sys.stdin.readline()
        acks: dict[str, str] = {}
        for body in sorted(later & set(got)):
            until = time.monotonic() + 20
            while True:
                try:
                    consumer.ack(got[body])
                    acks[body] = "ok"
                    break
                except Exception as exc:  # the broker may not be reachable yet
                    refused = type(exc).__name__ == "BadRequestException"  # the answer
                    if refused or time.monotonic() > until:
                        acks[body] = str(exc)
                        break
                    time.sleep(0.3)
        return {"received": sorted(got), "acks": acks}
    finally:
        consumer.shutdown()


def main() -> None:
    endpoint, command, raw = sys.argv[1], sys.argv[2], sys.argv[3]
    fn = {"produce": produce, "produce_unknown": produce_unknown, "resend": resend,
          "simple": simple, "push": push, "push_live": push_live,
          "simple_hold": simple_hold, "signed": signed}[command]
    print(json.dumps(fn(endpoint, json.loads(raw))), flush=True)


if __name__ == "__main__":
    main()
