"""The duplicate audit in plain Python, for the traces a console page can read.

The rules are those of ``onceq audit`` (``spark/audit.py``, whose module doc explains
them); this module applies them to rows in memory instead of a Spark job, so the console
needs neither Spark nor Java. It is meant for small traces: the console reads at most
``max_records`` trace messages per queue of ``%TRACE%`` (the newest) and says so when it
left older ones out; for a whole trace, run ``onceq audit``.

Per group, each delivery of a unique key after its first is a duplicate, with one cause:

* the same stored copy (topic, queue, offset) was delivered before (last at ``p``):
  ``broker_restart`` when a broker start lies in (p, d], else ``crash`` when ``p``'s
  client left without unregistering (``disconnect`` or ``expired``) in (p, d], else
  ``rebalance``;
* a copy new to the group: ``retry`` when its reconsume count is above 0, else
  ``producer_resend``.

Only records carrying the broker's mark (``src=broker``) count.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..log.record import MessageExt
from ..protocol.codes import PROP_TRACE_SOURCE, TRACE_SOURCE_BROKER

CAUSES = ("rebalance", "crash", "broker_restart", "retry", "producer_resend")


@dataclass(frozen=True, slots=True)
class Delivery:
    """One message the broker delivered to a member of a traced group."""

    group: str
    client: str
    topic: str
    queue: int
    offset: int
    unique_key: str
    reconsume: int
    ts: int  # ms: when the broker answered the pull
    seq: int = 0  # orders the records of one broker run within a millisecond
    handover: bool = False  # this pull made the client the queue's access-lock holder


@dataclass(frozen=True, slots=True)
class Event:
    """A broker start (``kind="broker"``) or a membership change (``kind="member"``)."""

    kind: str
    ts: int
    seq: int = 0
    group: str = ""
    client: str = ""
    event: str = ""


@dataclass(frozen=True, slots=True)
class Attributed:
    delivery: Delivery
    duplicate: bool
    cause: str | None  # one of CAUSES for a duplicate


def trace_rows(messages: Iterable[MessageExt]) -> tuple[list[Delivery], list[Event], int]:
    """The deliveries and events of trace messages, and how many records were skipped
    (no broker mark, or a body or property that does not parse)."""
    deliveries: list[Delivery] = []
    events: list[Event] = []
    skipped = 0
    for m in messages:
        p = m.properties
        if p.get(PROP_TRACE_SOURCE) != TRACE_SOURCE_BROKER:
            skipped += 1
            continue
        try:
            seq = int(p.get("seq") or 0)
            kind = str(p.get("kind", ""))
            if kind == "deliver":
                topic, queue = str(p["topic"]), int(p["queue"])
                group, client = str(p["group"]), str(p.get("client", ""))
                handover = str(p.get("handover", "0")) == "1"
                for item in json.loads(m.body):
                    deliveries.append(Delivery(group, client, topic, queue, int(item["o"]),
                                               str(item["k"]), int(item["r"]),
                                               m.born_ts_ms, seq, handover))
            else:
                events.append(Event(kind, m.born_ts_ms, seq, str(p.get("group", "")),
                                    str(p.get("client", "")), str(p.get("event", ""))))
        except (KeyError, ValueError, TypeError):
            skipped += 1
    return deliveries, events, skipped


def _between(ev: Event, after: Delivery, upto: Delivery) -> bool:
    """Whether ``ev`` came after ``after`` and not after ``upto`` (time, then order)."""
    return (ev.ts, ev.seq) > (after.ts, after.seq) and not (ev.ts, ev.seq) > (upto.ts, upto.seq)


def attribute(deliveries: Sequence[Delivery], events: Sequence[Event],
              groups: Sequence[str] | None = None) -> list[Attributed]:
    """Every delivery (of ``groups``, or all) with its duplicate flag and cause, in the
    order of delivery."""
    rows = [d for d in deliveries if not groups or d.group in groups]
    by_key = sorted(rows, key=lambda d: (d.group, d.unique_key, d.ts, d.seq, d.reconsume,
                                         d.topic, d.queue, d.offset, d.client))
    first: set[tuple[str, str]] = set()
    duplicate: dict[int, bool] = {}
    for d in by_key:
        k = (d.group, d.unique_key)
        duplicate[id(d)] = k in first
        first.add(k)
    previous: dict[int, Delivery] = {}
    last_copy: dict[tuple[str, str, int, int], Delivery] = {}
    for d in sorted(rows, key=lambda d: (d.ts, d.seq, d.reconsume, d.client)):
        k2 = (d.group, d.topic, d.queue, d.offset)
        if k2 in last_copy:
            previous[id(d)] = last_copy[k2]
        last_copy[k2] = d
    starts = [e for e in events if e.kind == "broker"]
    gone: dict[tuple[str, str], list[Event]] = defaultdict(list)
    for e in events:
        if e.kind == "member" and e.event in ("disconnect", "expired"):
            gone[(e.group, e.client)].append(e)
    out = []
    for d in sorted(rows, key=lambda d: (d.ts, d.seq, d.group, d.topic, d.queue, d.offset)):
        cause = None
        if duplicate[id(d)]:
            p = previous.get(id(d))
            if p is not None:
                if any(_between(e, p, d) for e in starts):
                    cause = "broker_restart"
                elif any(_between(e, p, d) for e in gone.get((d.group, p.client), ())):
                    cause = "crash"
                else:
                    cause = "rebalance"
            else:
                cause = "retry" if d.reconsume > 0 else "producer_resend"
        out.append(Attributed(d, duplicate[id(d)], cause))
    return out


@dataclass
class AuditSummary:
    """Totals per group and counts per group and time window (tumbling, of delivery
    time), in the shape of ``onceq audit --json``."""

    groups: list[dict[str, Any]] = field(default_factory=list)
    windows: list[dict[str, Any]] = field(default_factory=list)


def summarize(rows: Sequence[Attributed], window_s: int = 60) -> AuditSummary:
    def empty(**kw: Any) -> dict[str, Any]:
        return {**kw, "deliveries": 0, "duplicates": 0, "handover_deliveries": 0,
                "causes": dict.fromkeys(CAUSES, 0)}

    totals: dict[str, dict[str, Any]] = {}
    windows: dict[tuple[str, int], dict[str, Any]] = {}
    step = window_s * 1000
    for r in rows:
        d = r.delivery
        start = d.ts - d.ts % step
        t = totals.setdefault(d.group, empty(group=d.group))
        w = windows.setdefault((d.group, start), empty(group=d.group, start_ms=start,
                                                       end_ms=start + step))
        for acc in (t, w):
            acc["deliveries"] += 1
            acc["handover_deliveries"] += int(d.handover)
            if r.duplicate:
                acc["duplicates"] += 1
                assert r.cause is not None
                acc["causes"][r.cause] += 1
    for t in totals.values():  # each key's first delivery is the one that is no duplicate
        t["unique_keys"] = t["deliveries"] - t["duplicates"]
    return AuditSummary([totals[g] for g in sorted(totals)],
                        [windows[k] for k in sorted(windows)])
