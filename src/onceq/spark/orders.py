"""Order events for the pipeline (seed example: orders decrementing inventory), with
duplicate sends injected, and the totals a correct pipeline must reach (no pyspark here)."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

__all__ = ["OrderEvent", "expected_totals", "make_orders", "send_orders"]

# The JSON body of an order event, as a Spark DDL schema.
ORDER_SCHEMA = "order_id STRING, product STRING, quantity INT, event_time TIMESTAMP"


@dataclass(frozen=True, slots=True)
class OrderEvent:
    order_id: str
    product: str
    quantity: int
    event_time: datetime
    duplicate: bool = False  # a copy of an event sent before (same body)

    def body(self) -> bytes:
        return json.dumps({"order_id": self.order_id, "product": self.product,
                           "quantity": self.quantity,
                           "event_time": self.event_time.isoformat(timespec="milliseconds")
                           .replace("+00:00", "Z")}, separators=(",", ":")).encode()


def make_orders(n: int, *, products: int = 5, duplicate_rate: float = 0.2,
                max_lag: int = 20, seed: int = 0, start: datetime | None = None,
                prefix: str = "order") -> list[OrderEvent]:
    """``n`` distinct orders one second apart in event time, plus about
    ``duplicate_rate * n`` duplicate sends, each a copy of an order sent at most ``max_lag``
    events earlier (a producer retry, a resend after a timeout). Deterministic for a seed."""
    rng = random.Random(seed)
    t0 = start or datetime(2026, 1, 1, tzinfo=UTC)
    out: list[OrderEvent] = []
    for i in range(n):
        ev = OrderEvent(f"{prefix}-{i}", f"product-{rng.randrange(products)}",
                        rng.randint(1, 5), t0 + timedelta(seconds=i))
        out.append(ev)
        if rng.random() < duplicate_rate:
            back = out[max(0, len(out) - 1 - rng.randrange(max_lag + 1))]
            copy = OrderEvent(back.order_id, back.product, back.quantity, back.event_time,
                              True)
            out.append(copy)
    return out


def expected_totals(events: Iterable[OrderEvent]) -> dict[str, tuple[int, int]]:
    """Per product: (quantity, orders), each order counted once."""
    seen: dict[str, OrderEvent] = {}
    for e in events:
        seen.setdefault(e.order_id, e)
    qty: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for e in seen.values():
        qty[e.product] += e.quantity
        count[e.product] += 1
    return {p: (qty[p], count[p]) for p in sorted(qty)}


def send_orders(servers: str, topic: str, events: Iterable[OrderEvent]) -> int:
    """Send each event as a message (keys: the order id); returns how many were sent.
    A duplicate is a new send of the same body (a new unique key, as an application
    retry produces), so the broker's dedup window does not catch it."""
    from ..client.message import Message
    from ..client.sync import SyncProducer

    sent = 0
    with SyncProducer(servers) as producer:
        for e in events:
            producer.send(topic, Message(e.body(), keys=e.order_id, tags=e.product))
            sent += 1
    return sent
