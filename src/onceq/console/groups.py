"""Consumer groups: the list, one group's members, assignment, lag per queue (a chart over
time while the page is open), lock holders and in-flight counts; its delivery trace on or
off; an offset reset by offset or time, after a confirmation step, under the broker's
GROUP_ACTIVE rule (refused while members are live, unless forced)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from ..client.admin import GroupStatus
from . import forms
from .access import PAGE_ERRORS, ConsoleAdmin
from .charts import lag_chart
from .web import Console, Refused, console_of, failed, mutation_form, problem, refused, render


def _label(topic: str, queue: int) -> str:
    return f"{topic}[{queue}]"


def queue_rows(status: GroupStatus) -> list[dict[str, Any]]:
    rows = []
    for q in status.queues:
        in_flight = None
        if q.deliver_offset is not None:
            done = q.min_offset if q.committed is None else q.committed
            in_flight = max(0, q.deliver_offset - max(done, q.min_offset))
        rows.append({"topic": q.topic, "queue": q.queue_id, "min": q.min_offset,
                     "max": q.max_offset, "committed": q.committed, "lag": q.lag,
                     "owner": q.expected_owner, "lock_holder": q.lock_holder,
                     "deliver": q.deliver_offset, "in_flight": in_flight,
                     "handover_pending": q.handover_pending,
                     "orderly_holder": q.orderly_holder, "orderly_age_s": q.orderly_age_s,
                     "fuse_limit": q.fuse_limit, "fuse_tripped": q.fuse_tripped})
    return rows


async def _sample(c: Console, admin: ConsoleAdmin, group: str) -> dict[str, Any]:
    """The group's status now, recorded as a lag sample; what the lag panel shows."""
    status = await admin.group_status(group)
    c.lag.add(group, {_label(q.topic, q.queue_id): q.lag for q in status.queues})
    return {"status": status, "rows": queue_rows(status),
            "chart": lag_chart(c.lag.series(group)), "total_lag": status.lag}


async def group_list(request: Request) -> HTMLResponse:
    c = console_of(request)
    rows = []
    try:
        async with c.admin() as admin:
            for g in await admin.list_groups():
                if g.startswith("%"):
                    continue
                st = await admin.group_status(g)
                rows.append({"group": g, "members": len(st.members),
                             "topics": sorted({q.topic for q in st.queues}), "lag": st.lag})
    except PAGE_ERRORS as exc:
        return failed(request, exc, "groups.html", rows=[])
    return render(request, "groups.html", rows=rows)


async def group_page(request: Request) -> HTMLResponse:
    c = console_of(request)
    group = request.path_params["group"]
    try:
        async with c.admin() as admin:
            panel = await _sample(c, admin, group)
            traced = await admin.group_trace(group)
            dlq = await admin.dead_letter_offsets(group)
    except PAGE_ERRORS as exc:
        return failed(request, exc, "group.html", group=group, panel=None)
    topics = sorted({q.topic for q in panel["status"].queues})
    return render(request, "group.html", group=group, panel=panel, traced=traced, dlq=dlq,
                  topics=topics, notice=request.query_params.get("notice"))


async def group_lag(request: Request) -> HTMLResponse:
    """The lag panel alone (an open group page refreshes it: each refresh is a sample)."""
    c = console_of(request)
    group = request.path_params["group"]
    try:
        async with c.admin() as admin:
            panel = await _sample(c, admin, group)
    except PAGE_ERRORS as exc:
        p = problem(request, exc)
        return render(request, "group_lag.html", p.status, error=p, group=group, panel=None)
    return render(request, "group_lag.html", group=group, panel=panel)


async def group_trace(request: Request) -> Response:
    c = console_of(request)
    group = request.path_params["group"]
    try:
        form = await mutation_form(request)
    except Refused as exc:
        return refused(request, exc)
    try:
        on = forms.choice(form.get("state"), "state", ("on", "off")) == "on"  # type: ignore[arg-type]
        async with c.admin() as admin:
            await admin.group_members(group)  # GROUP_NOT_EXIST for a group never seen
            now = await admin.group_trace(group, on)
    except PAGE_ERRORS as exc:
        return failed(request, exc, "group.html", group=group, panel=None)
    notice = f"delivery trace of group {group}: {'on' if now else 'off'}"
    return RedirectResponse(f"/groups/{quote(group, safe='')}?notice={quote(notice)}",
                            status_code=303)


async def group_reset(request: Request) -> Response:
    """First post: what would move, to confirm. Second post (``confirm=yes``): the reset,
    and what moved."""
    c = console_of(request)
    group = request.path_params["group"]
    try:
        form = await mutation_form(request)
    except Refused as exc:
        return refused(request, exc)
    kept = {k: str(form.get(k, "")) for k in ("topic", "mode", "value", "queue")}
    force = form.get("force") == "on"
    back = f"/groups/{quote(group, safe='')}"
    try:
        topic = forms.text(kept["topic"], "topic")
        mode = forms.choice(kept["mode"], "reset to", ("offset", "time"))
        if mode == "offset":
            to_offset, to_time = forms.integer(kept["value"], "offset"), None
        else:
            to_offset, to_time = None, forms.time_ms(kept["value"], "time")
        queue = forms.optional_integer(kept["queue"], "queue", high=(1 << 31) - 1)
        async with c.admin() as admin:
            if form.get("confirm") == "yes":
                moved = await admin.reset_offsets(group, topic, to_offset=to_offset,
                                                  to_time_ms=to_time, queue=queue,
                                                  force=force)
                return render(request, "reset_done.html", group=group, topic=topic,
                              moved=moved, back=back)
            members = await admin.group_members(group)
            n = await admin.queue_count(topic)
            if queue is not None and queue >= n:
                raise forms.InputError(f"queue: topic {topic} has queues 0..{n - 1}")
            plan = []
            for q in [queue] if queue is not None else range(n):
                lo, hi = await admin.queue_offsets(topic, q)
                target = (min(max(to_offset, lo), hi) if to_offset is not None
                          else await admin.search_offset(topic, q, to_time or 0))
                plan.append({"queue": q, "min": lo, "max": hi,
                             "committed": await admin.group_offset(group, topic, q),
                             "target": target})
    except PAGE_ERRORS as exc:
        return failed(request, exc, "error.html", back=back)
    what = (f"offset {to_offset}" if to_offset is not None
            else f"the first message stored at or after {forms.iso_ms(to_time)} UTC")
    return render(request, "reset_confirm.html", group=group, topic=topic, plan=plan,
                  what=what, members=members, force=force,
                  fields={**kept, "force": "on" if force else ""},
                  action=f"/groups/{quote(group, safe='')}/reset", back=back)


def routes() -> list[Route]:
    return [Route("/groups", group_list, name="groups"),
            Route("/groups/{group}/lag", group_lag, name="group_lag"),
            Route("/groups/{group}/reset", group_reset, methods=["POST"]),
            Route("/groups/{group}/trace", group_trace, methods=["POST"]),
            Route("/groups/{group}", group_page, name="group")]
