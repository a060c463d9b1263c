"""Overview: the broker's store and write state, disk use against the write-refusal ratio,
message rates (live), connections, and the error counters it exports."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from ..protocol.codes import SYSTEM_PREFIX
from .access import PAGE_ERRORS, ConsoleAdmin
from .metrics import MetricsError, scrape
from .web import Console, console_of, failed, problem, render

# counters of things that went wrong, as the broker exports them (docs/broker.md#metrics)
ERROR_COUNTERS = (
    ("onceq_connections_refused_total", "connections refused at the connection cap"),
    ("onceq_output_budget_drops_total", "clients dropped for not reading their answers"),
    ("onceq_schedule_skipped_total", "schedule records skipped as undeliverable"),
    ("onceq_dlq_messages_total", "messages moved to a dead-letter queue"),
)


async def _stored(admin: ConsoleAdmin) -> tuple[list[dict[str, Any]], int]:
    """Per user topic: queues, messages held, messages ever stored (the sum of max
    offsets), last store time."""
    out = []
    for t in await admin.list_topics():
        name = t["topic"]
        if name.startswith(SYSTEM_PREFIX):
            continue
        queues = await admin.topic_status(name)
        last = [q["last_store_ms"] for q in queues if q["last_store_ms"] is not None]
        out.append({"topic": name, "queues": len(queues),
                    "messages": sum(q["max"] - q["min"] for q in queues),
                    "stored": sum(q["max"] for q in queues),
                    "last_store_ms": max(last) if last else None})
    return out, sum(t["stored"] for t in out)


async def live(c: Console, admin: ConsoleAdmin) -> dict[str, Any]:
    """What the live panel shows; every call reads the broker (and its metrics) once."""
    topics, stored = await _stored(admin)
    out: dict[str, Any] = {"topics": topics, "stored": stored,
                           "stored_rate": c.rates.rate("stored", stored),
                           "metrics": None, "metrics_error": None}
    if c.config.metrics_url:
        try:
            m = await scrape(c.config.metrics_url)
        except MetricsError as exc:
            out["metrics_error"] = str(exc)
        else:
            msg_in = m.value("onceq_messages_in_total", 0.0) or 0.0
            msg_out = m.value("onceq_messages_out_total", 0.0) or 0.0
            security = m.by("onceq_security_events_total", "event")
            out["metrics"] = {
                "in_rate": c.rates.rate("in", msg_in),
                "out_rate": c.rates.rate("out", msg_out),
                "in_total": msg_in, "out_total": msg_out,
                "dedup_hits": m.value("onceq_dedup_hits_total", 0.0),
                "connections": m.value("onceq_connections"),
                "members": m.value("onceq_group_members", 0.0),
                "disk_bytes": m.value("onceq_disk_used_bytes"),
                "in_by_topic": m.by("onceq_messages_in_total", "topic"),
                "out_by_topic": m.by("onceq_messages_out_total", "topic"),
                "errors": [(label, m.value(name, 0.0)) for name, label in ERROR_COUNTERS]
                + [(f"security: {ev}", n) for ev, n in sorted(security.items())],
            }
    return out


async def overview(request: Request) -> HTMLResponse:
    c = console_of(request)
    try:
        async with c.admin() as admin:
            status = await admin.broker_status()
            groups = [g for g in await admin.list_groups() if not g.startswith("%")]
            now = await admin.ping()
            data = await live(c, admin)
    except PAGE_ERRORS as exc:
        return failed(request, exc, "overview.html")
    return render(request, "overview.html", status=status, groups=groups, now_ms=now,
                  live=data)


async def overview_live(request: Request) -> HTMLResponse:
    """The live panel alone (an open overview page refreshes it)."""
    c = console_of(request)
    try:
        async with c.admin() as admin:
            data = await live(c, admin)
    except PAGE_ERRORS as exc:
        return render(request, "overview_live.html", problem(request, exc).status,
                      error=problem(request, exc))
    return render(request, "overview_live.html", live=data)


def routes() -> list[Route]:
    return [Route("/", overview, name="overview"),
            Route("/live/overview", overview_live, name="overview_live")]
