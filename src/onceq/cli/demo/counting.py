"""From the run's records to its figures: every count is computed here, after the run,
from what was recorded (sends, each delivery and its outcome, each effect row).

A delivery is the first of its order, or a duplicate with exactly one cause, found from
the records in this order:

* another unique key than the order's earlier deliveries: an **application re-send** (a
  producer retry keeps its unique key, so another key is another message);
* from the group's retry topic: a **retry** (an attempt that answered "consume later");
* the same unique key at a stored position not delivered before: a **producer retry
  stored twice** (no dedup window);
* the same stored message again: **member SIGKILLed** when the member that had it before
  was killed after that delivery; **broker SIGKILLed** when the broker was killed between
  the two deliveries; otherwise **rebalance** (the queue moved while it was in flight).

Every delivery also gets its outcome: **applied** (its effect row exists), **acknowledged
without effect** (the idempotency layer found the order done), **consumed later** (the
attempt answered "later", e.g. the order was claimed by a live attempt), or
**interrupted** (no answer recorded: its member was killed).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...protocol.codes import RETRY_PREFIX
from . import shop
from .scenario import RunData

CAUSES = ("application re-send", "producer retry stored twice", "retry (consume later)",
          "member SIGKILLed", "broker SIGKILLed", "rebalance")
OUTCOMES = ("applied", "acknowledged without effect", "consumed later", "interrupted")


@dataclass
class Delivery:
    id: str
    t: float
    member: str
    unique_key: str
    order_id: str
    topic: str
    queue: int
    offset: int
    reconsume: int
    cause: str = "first"
    outcome: str = "interrupted"


@dataclass
class Summary:
    protected: bool
    orders: int  # distinct orders the application sent
    sent: int  # messages the application sent (orders + re-sends)
    resends: int
    lost_replies: int  # send replies the proxy dropped
    app_send_retries: int  # sends repeated by the application while the broker was down
    broker_dedup_hits: int  # sends the broker answered "already stored"
    stored: int
    deliveries: int
    unique_delivered: int  # distinct orders delivered
    duplicates_by_cause: dict[str, int]
    outcomes: dict[str, int]
    locked_pulls: int
    idempotency_removed: int  # duplicate deliveries that did not reach the effect
    applied: int  # effect rows (business effects)
    applied_orders: int  # distinct orders with an effect
    duplicate_effects: int
    lost: int
    stock_consumed: int  # initial stock minus stock now, over all items
    effects_qty: int  # the quantities of the effect rows
    stock_expected: int  # the sum of the orders' quantities
    produce_s: float
    total_s: float
    produce_rate: float
    delivery_rate: float
    drained: bool
    spark: dict[str, Any] = field(default_factory=dict)

    @property
    def duplicate_deliveries(self) -> int:
        return self.deliveries - self.unique_delivered

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["duplicate_deliveries"] = self.duplicate_deliveries
        return d


def read_deliveries(directory: str) -> list[Delivery]:
    deliveries: dict[str, Delivery] = {}
    answers: dict[str, str] = {}
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line cut by the SIGKILL
            if r["k"] == "d":
                deliveries[r["id"]] = Delivery(r["id"], r["t"], r["m"], r["uk"], r["o"],
                                               r["tp"], r["q"], r["off"], r["rc"])
            else:
                for i, did in enumerate(r["ids"]):
                    answers[did] = "acked" if i < r["acked"] else "later"
    out = sorted(deliveries.values(), key=lambda d: d.t)
    for d in out:
        if d.id in answers:
            d.outcome = ("acknowledged without effect" if answers[d.id] == "acked"
                         else "consumed later")
    return out


def classify(deliveries: list[Delivery], kills: dict[str, float],
             broker_kills: list[float], applied_ids: set[str]) -> None:
    """Set each delivery's cause and outcome (see the module's docstring)."""
    keys_of: dict[str, set[str]] = defaultdict(set)
    copies: set[tuple[str, int, int]] = set()
    last: dict[tuple[str, int, int], Delivery] = {}
    for d in deliveries:
        if d.id in applied_ids:
            d.outcome = "applied"
        pos = (d.topic, d.queue, d.offset)
        if not keys_of[d.order_id]:
            d.cause = "first"
        elif d.unique_key not in keys_of[d.order_id]:
            # a producer retry keeps its unique key: another key is another message
            d.cause = "application re-send"
        elif d.topic.startswith(RETRY_PREFIX):
            d.cause = "retry (consume later)"
        elif pos not in copies:
            d.cause = "producer retry stored twice"
        else:
            prev = last[pos]
            if prev.member in kills and kills[prev.member] >= prev.t:
                d.cause = "member SIGKILLed"
            elif any(prev.t <= k <= d.t for k in broker_kills):
                d.cause = "broker SIGKILLed"
            else:
                d.cause = "rebalance"
        keys_of[d.order_id].add(d.unique_key)
        copies.add(pos)
        last[pos] = d


def summarise(data: RunData) -> tuple[Summary, list[Delivery]]:
    cfg = data.config
    effects, stock = shop.read_effects(f"{cfg.workdir}/shop.db")
    deliveries = read_deliveries(f"{cfg.workdir}/deliveries")
    resend_keys = {s.unique_key for s in data.sends if s.resend}
    classify(deliveries, data.kills, data.broker_kills, {e[2] for e in effects})
    causes = Counter(d.cause for d in deliveries if d.cause != "first")
    outcomes = Counter(d.outcome for d in deliveries)
    orders = {o.order_id: o for o in data.orders}
    applied_orders = {e[0] for e in effects}
    qty = sum(orders[e[0]].qty for e in effects)
    consumed = sum(shop.INITIAL_STOCK - v for v in stock.values())
    produce_s = max(data.t_produced - data.t0, 1e-9)
    total_s = max(data.t_end - data.t0, 1e-9)
    span = (deliveries[-1].t - deliveries[0].t) if len(deliveries) > 1 else 0.0
    dup_removed = sum(1 for d in deliveries
                      if d.cause != "first" and d.outcome in ("acknowledged without effect",
                                                              "consumed later"))
    s = Summary(
        protected=cfg.protected,
        orders=len(orders),
        sent=len(data.sends),
        resends=len(resend_keys),
        lost_replies=len(data.lost_replies),
        app_send_retries=sum(s.app_retries for s in data.sends),
        broker_dedup_hits=sum(1 for s in data.sends if s.duplicate),
        stored=data.stored,
        deliveries=len(deliveries),
        unique_delivered=len({d.order_id for d in deliveries}),
        duplicates_by_cause={c: causes.get(c, 0) for c in CAUSES},
        outcomes={o: outcomes.get(o, 0) for o in OUTCOMES},
        locked_pulls=data.locked_pulls,
        idempotency_removed=dup_removed if cfg.protected else 0,
        applied=len(effects),
        applied_orders=len(applied_orders),
        duplicate_effects=len(effects) - len(applied_orders),
        lost=len(set(orders) - applied_orders),
        stock_consumed=consumed,
        effects_qty=qty,
        stock_expected=sum(o.qty for o in data.orders),
        produce_s=produce_s,
        total_s=total_s,
        produce_rate=len(data.sends) / produce_s,
        delivery_rate=len(deliveries) / span if span else 0.0,
        drained=data.drained,
    )
    return s, deliveries


def timeline(deliveries: list[Delivery], t0: float, t_end: float, bins: int = 60
             ) -> dict[str, Any]:
    """Deliveries, duplicate deliveries and duplicate effects per time bin."""
    width = max((t_end - t0) / bins, 0.05)
    n = int((t_end - t0) / width) + 1
    series = {k: [0] * n for k in ("deliveries", "duplicates", "duplicate effects")}
    seen_effect: set[str] = set()
    for d in deliveries:
        i = min(max(int((d.t - t0) / width), 0), n - 1)
        series["deliveries"][i] += 1
        if d.cause != "first":
            series["duplicates"][i] += 1
        if d.outcome == "applied":
            if d.order_id in seen_effect:
                series["duplicate effects"][i] += 1
            seen_effect.add(d.order_id)
    return {"width": width, "series": series}
