"""The official RocketMQ 5 Python client (``rocketmq-python-client``) driven against an
onceq broker's gRPC endpoint, in a process of its own (its ``rocketmq`` package and its
protocol descriptors cannot share a process with onceq's).

    python rmq_proc.py ENDPOINT COMMAND JSON_ARGS

prints one JSON object on its last stdout line. Commands: ``produce``, ``produce_unknown``,
``resend`` (one SendMessage request sent twice, as a retry after a lost answer; with
``deliver_at_s``, a delayed message), ``receive`` (a SimpleConsumer acknowledging what
it receives, with each message's delivery timestamp and arrival time),
``simple`` (a SimpleConsumer: receive, change invisible duration, ack, redelivery),
``push`` (a PushConsumer for a while), ``simple_hold`` (a SimpleConsumer
acknowledging with handles received before a broker restart), ``push_live`` (a
PushConsumer until told to stop:
prints ``ready`` once started, appends each message it consumes to a file, shuts down
gracefully at a line on stdin or at SIGTERM), ``signed`` (raw requests with a given
``authorization`` and ``x-mq-date-time``: the broker's answer to each), ``fifo_simple``
(a SimpleConsumer of a FIFO group: per message group, stops at a message it leaves
unacknowledged and records the order it consumed in), ``fifo_push`` (a FIFO PushConsumer
whose listener fails some messages), ``never_ack`` (a SimpleConsumer that acknowledges
nothing: each delivery and its attempt), ``forward`` (a SimpleConsumer forwarding
messages to the dead-letter queue with ``ForwardMessageToDeadLetterQueue``).

``produce`` takes per message ``group`` (a FIFO message of that message group) and
``delay_s`` (a delayed message, its delivery timestamp that many whole seconds ahead:
its receipt with ``deliver_at_s``, the timestamp in seconds, or its error).

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
            if m.get("group"):
                msg.message_group = m["group"]
            if m.get("delay_s"):  # whole seconds, as the client takes them
                at = int(time.time()) + m["delay_s"]
                msg.delivery_timestamp = at
                try:
                    receipt = producer.send(msg)
                except Exception as exc:
                    out.append({"error": str(exc), "type": type(exc).__name__})
                    continue
                out.append({"message_id": receipt.message_id, "offset": receipt.offset,
                            "deliver_at_s": at, "sent_at": time.time()})
                continue
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
    if args.get("deliver_at_s"):  # a delayed message, as another client would send it
        m.system_properties.message_type = 3  # DELAY
        m.system_properties.delivery_timestamp.seconds = int(time.time()) + args[
            "deliver_at_s"]
    m.system_properties.born_timestamp.GetCurrentTime()
    md = (("x-mq-client-id", "resend-test"),)
    out = []
    with grpc.insecure_channel(endpoint) as ch:
        stub = service_pb2_grpc.MessagingServiceStub(ch)
        for _ in range(args.get("times", 2)):
            res = stub.SendMessage(req, metadata=md, timeout=5)
            e = res.entries[0]
            out.append({"code": res.status.code, "message_id": e.message_id,
                        "offset": e.offset, "message": res.status.message})
    return {"answers": out}


def receive(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    """A SimpleConsumer of ``group`` acknowledging what it receives within ``wait_s``:
    each message with its delivery timestamp, properties and arrival time."""
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


def fifo_simple(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    """A SimpleConsumer of a FIFO group consuming until ``n`` messages are acknowledged:
    per message group in the order received; a message in ``leave`` (bodies) is left
    unacknowledged at its first delivery, and so are the messages of its group after it in
    that batch (a FIFO consumer stops the group at a failure). ``violations``: deliveries
    of a message while an earlier one of its group was out and not acknowledged."""
    consumer = SimpleConsumer(config(endpoint, args), args["group"],
                              {args["topic"]: FilterExpression()},
                              await_duration=args.get("await", 2))
    consumer.startup()
    leave = set(args.get("leave", []))
    acked: list[str] = []
    deliveries: list[list[Any]] = []
    violations: list[str] = []
    out: dict[str, str] = {}  # body -> its message group: received, not acknowledged
    deadline = time.monotonic() + args.get("timeout", 30)
    try:
        while len(acked) < args["n"] and time.monotonic() < deadline:
            batch = consumer.receive(args.get("batch", 16), args.get("invisible", 3))
            bodies = {m.body.decode() for m in batch}
            waiting = {g for b, g in out.items() if b not in bodies}
            stopped: set[str] = set()
            for m in batch:
                body, group = m.body.decode(), m.message_group or ""
                deliveries.append([body, m.delivery_attempt, group])
                if group in waiting:
                    violations.append(body)
                if group in stopped or (body in leave and m.delivery_attempt == 1):
                    stopped.add(group)
                    out[body] = group
                    continue
                consumer.ack(m)
                out.pop(body, None)
                acked.append(body)
        return {"acked": acked, "deliveries": deliveries, "violations": violations}
    finally:
        consumer.shutdown()


def fifo_push(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    """A PushConsumer (FIFO when the broker says the group is) consuming until ``n``
    messages were consumed successfully or ``timeout``; its listener fails the messages in
    ``fail`` (bodies) always, and those in ``fail_once`` at their first local attempt.
    ``log``: [body, message group, delivery attempt, result] per listener call."""
    log: list[list[Any]] = []
    lock = threading.Lock()
    done = threading.Event()
    fail, fail_once = set(args.get("fail", [])), set(args.get("fail_once", []))
    tried: set[str] = set()
    ok = [0]

    class Listener(MessageListener):
        def consume(self, message: Message) -> ConsumeResult:
            body = message.body.decode()
            time.sleep(args.get("handler_ms", 0) / 1000)
            with lock:
                failed = body in fail or (body in fail_once and body not in tried)
                tried.add(body)
                log.append([body, message.message_group, message.delivery_attempt,
                            "fail" if failed else "ok"])
                if not failed:
                    ok[0] += 1
                    if ok[0] >= args["n"]:
                        done.set()
            return ConsumeResult.FAILURE if failed else ConsumeResult.SUCCESS

    consumer = PushConsumer(config(endpoint, args), args["group"], Listener(),
                            {args["topic"]: FilterExpression()},
                            consumption_thread_count=args.get("threads", 4))
    consumer.startup()
    try:
        done.wait(args.get("timeout", 30))
        time.sleep(args.get("linger", 0))
        with lock:
            return {"log": list(log), "fifo": consumer.fifo}
    finally:
        consumer.shutdown()


def never_ack(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    """Receive and acknowledge nothing, until ``idle`` seconds pass without a delivery
    (after ``min_s``), a delivery's attempt reaches ``until_attempt`` or ``timeout``: each
    delivery as [body, attempt]."""
    consumer = SimpleConsumer(config(endpoint, args), args["group"],
                              {args["topic"]: FilterExpression()}, await_duration=1)
    consumer.startup()
    got: list[list[Any]] = []
    t0 = last = time.monotonic()
    try:
        while time.monotonic() - t0 < args.get("timeout", 25):
            batch = consumer.receive(16, args.get("invisible", 1))
            for m in batch:
                got.append([m.body.decode(), m.delivery_attempt])
                last = time.monotonic()
            if any(a >= args.get("until_attempt", 1 << 30) for _b, a in got):
                break
            now = time.monotonic()
            if now - t0 >= args.get("min_s", 0) and now - last >= args.get("idle", 4):
                break
        return {"deliveries": got}
    finally:
        consumer.shutdown()


def forward(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    """Receive ``n`` messages; forward those in ``dlq`` (bodies) to the dead-letter queue
    with ``ForwardMessageToDeadLetterQueue`` (as a FIFO PushConsumer does), acknowledge the
    others; forward one of them again (its handle is then stale); then report what a
    further receive gets. ``answers``: the status code of each forward."""
    import grpc
    from rocketmq.grpc_protocol import service_pb2, service_pb2_grpc

    consumer = SimpleConsumer(config(endpoint, args), args["group"],
                              {args["topic"]: FilterExpression()}, await_duration=2)
    consumer.startup()
    got: dict[str, Any] = {}
    deadline = time.monotonic() + 20
    answers: dict[str, list[int]] = {}
    try:
        while len(got) < args["n"] and time.monotonic() < deadline:
            for m in consumer.receive(16, args.get("invisible", 30)):
                got[m.body.decode()] = m
        dlq = set(args.get("dlq", []))
        with grpc.insecure_channel(endpoint) as ch:
            stub = service_pb2_grpc.MessagingServiceStub(ch)
            md = (("x-mq-client-id", consumer.client_id),)
            for body in sorted(dlq & set(got)) + sorted(dlq & set(got))[:1]:
                m = got[body]
                req = service_pb2.ForwardMessageToDeadLetterQueueRequest()
                req.group.name = args["group"]
                req.topic.name = args["topic"]
                req.receipt_handle = m.receipt_handle
                req.message_id = m.message_id
                req.delivery_attempt = m.delivery_attempt
                req.max_delivery_attempts = 3
                res = stub.ForwardMessageToDeadLetterQueue(req, metadata=md, timeout=5)
                answers.setdefault(body, []).append(res.status.code)
        for body in sorted(set(got) - dlq):
            consumer.ack(got[body])
        extra = [m.body.decode() for m in consumer.receive(16, 5)]
        return {"received": sorted(got), "answers": answers, "extra": extra}
    finally:
        consumer.shutdown()


def main() -> None:
    endpoint, command, raw = sys.argv[1], sys.argv[2], sys.argv[3]
    fn = {"produce": produce, "produce_unknown": produce_unknown, "resend": resend,
          "receive": receive, "simple": simple, "push": push, "push_live": push_live,
          "simple_hold": simple_hold, "signed": signed, "fifo_simple": fifo_simple,
          "fifo_push": fifo_push, "never_ack": never_ack, "forward": forward}[command]
    print(json.dumps(fn(endpoint, json.loads(raw))), flush=True)


if __name__ == "__main__":
    main()
