"""Duplicates: the delivery trace of the groups with tracing on, each duplicate delivery
attributed to its cause (``audit.py``: the rules of ``onceq audit``, without Spark), over
time and per group, and what the broker-side layers removed."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from ..log.record import MessageExt
from ..protocol.codes import TRACE_TOPIC, PullStatus
from ..protocol.errors import ErrorCode, OnceqError
from .access import PAGE_ERRORS, ConsoleAdmin
from .audit import CAUSES, attribute, summarize, trace_rows
from .charts import duplicates_chart
from .metrics import MetricsError, scrape
from .web import console_of, failed, render

RECENT = 50  # duplicates listed, the newest first


async def read_trace(admin: ConsoleAdmin, per_queue: int) -> tuple[list[MessageExt], bool]:
    """The newest ``per_queue`` trace messages of each queue of %TRACE% (none when the
    topic does not exist yet), and whether older ones were left out."""
    try:
        n = await admin.queue_count(TRACE_TOPIC)
    except OnceqError as exc:
        if exc.code == ErrorCode.TOPIC_NOT_EXIST:
            return [], False
        raise
    out: list[MessageExt] = []
    cut = False
    for q in range(n):
        lo, hi = await admin.queue_offsets(TRACE_TOPIC, q)
        start = max(lo, hi - per_queue)
        cut = cut or start > lo
        offset = start
        while offset < hi:
            r = await admin.read_queue(TRACE_TOPIC, q, offset, min(256, hi - offset))
            if r.status not in (PullStatus.FOUND, PullStatus.DAMAGED) or \
                    r.next_offset <= offset:
                break
            out.extend(r.messages)
            offset = r.next_offset
    return out, cut


async def duplicates(request: Request) -> HTMLResponse:
    c = console_of(request)
    wanted = request.query_params.get("group") or None
    try:
        async with c.admin() as admin:
            groups = [g for g in await admin.list_groups() if not g.startswith("%")]
            traced = {g: await admin.group_trace(g) for g in groups}
            messages, cut = await read_trace(admin, c.config.max_trace_records)
    except PAGE_ERRORS as exc:
        return failed(request, exc, "duplicates.html", traced={}, summary=None, group=wanted)
    deliveries, events, skipped = trace_rows(messages)
    rows = attribute(deliveries, events, [wanted] if wanted else None)
    summary = summarize(rows, c.config.audit_window_s)
    recent = [r for r in reversed(rows) if r.duplicate][:RECENT]
    layers: dict[str, Any] = {"handover_deliveries": sum(int(r.delivery.handover)
                                                         for r in rows)}
    if c.config.metrics_url:
        try:
            m = await scrape(c.config.metrics_url)
            layers["dedup_hits"] = m.by("onceq_dedup_hits_total", "topic")
            layers["handovers"] = m.value("onceq_access_lock_handovers_total")
        except MetricsError as exc:
            layers["metrics_error"] = str(exc)
    return render(request, "duplicates.html", traced=traced, summary=summary,
                  causes=CAUSES, group=wanted, recent=recent, cut=cut, skipped=skipped,
                  records=len(messages), per_queue=c.config.max_trace_records,
                  chart=duplicates_chart(summary.windows, CAUSES), layers=layers,
                  window_s=c.config.audit_window_s)


def routes() -> list[Route]:
    return [Route("/duplicates", duplicates, name="duplicates")]
