"""The official RocketMQ 5 Python client under load and chaos, in a process of its own
(its ``rocketmq`` package cannot share a process with onceq's protocol descriptors):
what ``tests/rocketmq/test_chaos.py``, ``benchmarks/rocketmq_chaos.py`` and
``benchmarks/rocketmq_clients.py`` run.

    python rmq_load.py ENDPOINT COMMAND JSON_ARGS

prints one JSON object on its last stdout line.

Long-running commands (print ``ready`` once started, run until a line on stdin or SIGTERM,
append one line per event to the file ``out``, flushed as it happens; times are
``time.monotonic()``, one clock for every process of the machine):

* ``produce_live``: sync sends of bodies ``{prefix}-{i}``, each ``i`` sent once (a send
  that failed is not repeated: its body may or may not be stored). A send that was
  answered: ``S <time> <message id> <body> <queue offset>``.
* ``simple_live``: a SimpleConsumer receiving and acknowledging by receipt handle. Each
  delivery: ``R <time the receive was asked> <message id> <body> <attempt>``; each
  acknowledgement that was answered OK: ``A <time> <message id> <body>``; each that failed:
  ``F <time> <message id> <body>``.
* ``push_live``: a PushConsumer; each message its listener consumed:
  ``C <time> <message id> <body> <attempt>``; ``stop_after``: once it consumed that many,
  it prints ``enough`` on stdout (the caller then stops it gracefully); ``cache``: the
  client's ``max_cache_message_count`` (its graceful shutdown consumes what it cached).

Measuring commands (each times itself, after a warm-up):

* ``bench_produce``: ``n`` sends of ``size``-byte bodies, ``send`` (``in_flight`` 1) or
  ``send_async`` with ``in_flight`` futures outstanding.
* ``bench_simple``: a SimpleConsumer receiving batches of ``batch`` until ``n`` distinct
  messages were received, acknowledging each with ``ack`` or, with ``ack_in_flight`` above
  1, with that many ``ack`` calls running at once on as many threads (the client's
  ``ack_async`` returns no future in 5.1.2, so its completion cannot be waited for).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TextIO

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


def config(endpoint: str, timeout: float = 5) -> ClientConfiguration:
    return ClientConfiguration(endpoint, Credentials(), request_timeout=timeout)


class Events:
    """One line per event, appended and flushed under a lock (several threads write)."""

    def __init__(self, path: str) -> None:
        self._f: TextIO = open(path, "a", buffering=1)  # noqa: SIM115 (closed by close)
        self._lock = threading.Lock()
        self.count = 0

    def write(self, kind: str, *fields: object, at: float | None = None) -> None:
        """``kind``, the time (``at``, or now), ``fields``."""
        t = time.monotonic() if at is None else at
        line = " ".join([kind, f"{t:.6f}", *map(str, fields)])
        with self._lock:
            self._f.write(line + "\n")
            self.count += 1

    def close(self) -> None:
        with self._lock:
            self._f.close()


def _until_stopped() -> threading.Event:
    """Set at a line on stdin (or its end) or at SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    return stop


def _message(topic: str, body: bytes) -> Message:
    msg = Message()
    msg.topic = topic
    msg.body = body
    return msg


# ---------------------------------------------------------------- under chaos
def produce_live(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    topic, prefix = args["topic"], args.get("prefix", "m")
    pause = 1 / args["rate"] if args.get("rate") else 0.0
    producer = Producer(config(endpoint, args.get("timeout", 3)), (topic,))
    producer.startup()
    events = Events(args["out"])
    stop = _until_stopped()
    print("ready", flush=True)
    i = failed = 0
    errors: dict[str, int] = {}
    try:
        while not stop.is_set():
            body = f"{prefix}-{i}"
            i += 1
            try:
                receipt = producer.send(_message(topic, body.encode()))
            except Exception as exc:  # the broker is down: the next body, a moment later
                failed += 1
                name = type(exc).__name__
                errors[name] = errors.get(name, 0) + 1
                stop.wait(0.05)
                continue
            events.write("S", receipt.message_id, body, receipt.offset)
            if pause:
                stop.wait(pause)
        return {"attempted": i, "answered": events.count, "failed": failed,
                "errors": errors}
    finally:
        events.close()
        producer.shutdown()


def simple_live(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    topic = args["topic"]
    consumer = SimpleConsumer(config(endpoint, args.get("timeout", 3)), args["group"],
                              {topic: FilterExpression()},
                              await_duration=args.get("await", 1))
    consumer.startup()
    events = Events(args["out"])
    stop = _until_stopped()
    print("ready", flush=True)
    batch, invisible = args.get("batch", 16), args.get("invisible", 15)
    receive_errors = ack_errors = 0
    try:
        while not stop.is_set():
            asked = time.monotonic()
            try:
                msgs = consumer.receive(batch, invisible)
            except Exception:  # the broker is down, or nothing came
                receive_errors += 1
                stop.wait(0.05)
                continue
            for m in msgs:
                events.write("R", m.message_id, m.body.decode(), m.delivery_attempt,
                             at=asked)
            for m in msgs:
                try:
                    consumer.ack(m)
                except Exception:
                    ack_errors += 1
                    events.write("F", m.message_id, m.body.decode())
                    continue
                events.write("A", m.message_id, m.body.decode())
        return {"receive_errors": receive_errors, "ack_errors": ack_errors}
    finally:
        events.close()
        consumer.shutdown()


def push_live(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    events = Events(args["out"])
    lock = threading.Lock()
    stop_after = args.get("stop_after")
    handler_s = args.get("handler_ms", 0) / 1000
    consumed = [0]

    class Listener(MessageListener):
        def consume(self, message: Message) -> ConsumeResult:
            if handler_s:
                time.sleep(handler_s)
            events.write("C", message.message_id, message.body.decode(),
                         message.delivery_attempt)
            with lock:
                consumed[0] += 1
                if stop_after and consumed[0] == stop_after:
                    print("enough", flush=True)
            return ConsumeResult.SUCCESS

    consumer = PushConsumer(config(endpoint, args.get("timeout", 3)), args["group"],
                            Listener(), {args["topic"]: FilterExpression()},
                            consumption_thread_count=args.get("threads", 4),
                            max_cache_message_count=args.get("cache", 1024))
    consumer.startup()
    stop = _until_stopped()
    print("ready", flush=True)
    stop.wait()
    consumer.shutdown()
    events.close()
    with lock:
        return {"consumed": consumed[0]}


# ---------------------------------------------------------------- measuring
def bench_produce(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    topic, n = args["topic"], args["n"]
    body = b"x" * args.get("size", 100)
    in_flight = args.get("in_flight", 1)
    producer = Producer(config(endpoint), (topic,))
    producer.startup()
    try:
        for _ in range(args.get("warmup", 200)):
            producer.send(_message(topic, body))
        t0 = time.perf_counter()
        if in_flight <= 1:
            for _ in range(n):
                producer.send(_message(topic, body))
        else:
            _windowed(n, in_flight, lambda: producer.send_async(_message(topic, body)))
        elapsed = time.perf_counter() - t0
        return {"n": n, "seconds": elapsed, "rate": n / elapsed}
    finally:
        producer.shutdown()


def _windowed(n: int, in_flight: int, start: Callable[[], Future[Any]]) -> None:
    """Start ``n`` operations with at most ``in_flight`` outstanding; raise the first
    failure."""
    slots = threading.Semaphore(in_flight)
    done = threading.Event()
    failures: list[BaseException] = []
    left = [n]
    lock = threading.Lock()

    def finished(f: Future[Any]) -> None:
        exc = f.exception()
        with lock:
            if exc is not None:
                failures.append(exc)
            left[0] -= 1
            if left[0] == 0:
                done.set()
        slots.release()

    for _ in range(n):
        slots.acquire()
        if failures:
            break
        start().add_done_callback(finished)
    done.wait(120)
    if failures:
        raise failures[0]
    if not done.is_set():
        raise TimeoutError(f"{left[0]} of {n} operations unanswered")


def bench_simple(endpoint: str, args: dict[str, Any]) -> dict[str, Any]:
    topic, n = args["topic"], args["n"]
    consumer = SimpleConsumer(config(endpoint), args["group"], {topic: FilterExpression()},
                              await_duration=args.get("await", 2))
    consumer.startup()
    batch, ack_in_flight = args.get("batch", 32), args.get("ack_in_flight", 1)
    seen: set[str] = set()
    received = size = 0
    slots = threading.Semaphore(ack_in_flight)
    pool = ThreadPoolExecutor(max(ack_in_flight, 1))
    failures: list[BaseException] = []

    def acked(f: Future[Any]) -> None:
        if f.exception() is not None:
            failures.append(f.exception())  # type: ignore[arg-type]
        slots.release()

    try:
        deadline = time.monotonic() + args.get("timeout", 300)
        t0 = time.perf_counter()
        while len(seen) < n and time.monotonic() < deadline:
            for m in consumer.receive(batch, args.get("invisible", 60)):
                received += 1
                size += len(m.body)
                seen.add(m.message_id)
                if ack_in_flight <= 1:
                    consumer.ack(m)
                else:
                    slots.acquire()
                    pool.submit(consumer.ack, m).add_done_callback(acked)
        for _ in range(ack_in_flight if ack_in_flight > 1 else 0):
            slots.acquire()  # every acknowledgement answered
        elapsed = time.perf_counter() - t0
        if failures:
            raise failures[0]
        return {"n": len(seen), "received": received, "body_bytes": size,
                "seconds": elapsed, "rate": len(seen) / elapsed}
    finally:
        pool.shutdown()
        consumer.shutdown()


COMMANDS: dict[str, Callable[[str, dict[str, Any]], dict[str, Any]]] = {
    "produce_live": produce_live, "simple_live": simple_live, "push_live": push_live,
    "bench_produce": bench_produce, "bench_simple": bench_simple,
}


def main() -> None:
    endpoint, command, raw = sys.argv[1], sys.argv[2], sys.argv[3]
    print(json.dumps(COMMANDS[command](endpoint, json.loads(raw))), flush=True)


if __name__ == "__main__":
    main()
