"""Dead letters: the groups that have some, one group's letters with their reasons, and a
resend of one or all of them (after a confirmation step) through the group's retry topic
(``Admin.resend_dead_letters``)."""

from __future__ import annotations

from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from ..protocol.codes import (
    DLQ_PREFIX,
    PROP_DLQ_REASON,
    PROP_ORIGIN_OFFSET,
    PROP_ORIGIN_QUEUE,
    PROP_ORIGIN_TOPIC,
)
from . import forms
from .access import PAGE_ERRORS
from .messages import preview
from .web import Refused, console_of, failed, mutation_form, refused, render

PAGE = 100  # dead letters shown per page


async def dlq_list(request: Request) -> HTMLResponse:
    c = console_of(request)
    rows = []
    try:
        async with c.admin() as admin:
            for t in await admin.list_topics():
                if not t["topic"].startswith(DLQ_PREFIX):
                    continue
                lo, hi = await admin.queue_offsets(t["topic"], 0)
                rows.append({"group": t["topic"][len(DLQ_PREFIX):], "min": lo, "max": hi,
                             "count": hi - lo})
    except PAGE_ERRORS as exc:
        return failed(request, exc, "dlq_list.html", rows=[])
    return render(request, "dlq_list.html", rows=sorted(rows, key=lambda r: r["group"]))


async def dlq_group(request: Request) -> HTMLResponse:
    c = console_of(request)
    group = request.path_params["group"]
    ctx = {"group": group, "letters": [], "range": None}
    try:
        start = forms.optional_integer(request.query_params.get("start"), "start")
        async with c.admin() as admin:
            rng = await admin.dead_letter_offsets(group)
            letters = await admin.dead_letters(group, PAGE, start) if rng else []
    except PAGE_ERRORS as exc:
        return failed(request, exc, "dlq.html", **ctx)
    rows = []
    for m in letters:
        p = m.properties
        rows.append({"offset": m.queue_offset, "unique_key": m.unique_key, "keys": m.keys,
                     "tags": m.tags, "origin_topic": p.get(PROP_ORIGIN_TOPIC, "?"),
                     "origin_queue": p.get(PROP_ORIGIN_QUEUE, "?"),
                     "origin_offset": p.get(PROP_ORIGIN_OFFSET, "?"),
                     "reconsume": m.reconsume_times, "store_ms": m.store_ts_ms,
                     "reason": p.get(PROP_DLQ_REASON, ""), "body": preview(m.body, 120)})
    nxt = rows[-1]["offset"] + 1 if rows and rng and rows[-1]["offset"] + 1 < rng[1] else None
    return render(request, "dlq.html", group=group, letters=rows, range=rng, next=nxt)


async def dlq_resend(request: Request) -> Response:
    """First post: the confirmation page. Second post (``confirm=yes``): the resend, and
    where each letter went."""
    c = console_of(request)
    group = request.path_params["group"]
    back = f"/dlq/{quote(group, safe='')}"
    try:
        form = await mutation_form(request)
    except Refused as exc:
        return refused(request, exc)
    every = form.get("all") == "yes"
    try:
        offset = None if every else forms.integer(form.get("offset"),  # type: ignore[arg-type]
                                                  "offset")
        async with c.admin() as admin:
            if form.get("confirm") == "yes":
                done = await admin.resend_dead_letters(
                    group, None if offset is None else [offset])
                return render(request, "dlq_done.html", group=group, done=done, back=back)
            rng = await admin.dead_letter_offsets(group)
            if rng is None or rng[0] >= rng[1]:
                raise forms.InputError(f"group {group} has no dead letters")
            if offset is not None and not rng[0] <= offset < rng[1]:
                raise forms.InputError(f"offset: group {group}'s dead letters are at offsets "
                                       f"{rng[0]}..{rng[1] - 1}")
    except PAGE_ERRORS as exc:
        return failed(request, exc, "error.html", back=back)
    what = (f"all {rng[1] - rng[0]} dead letter(s)" if every
            else f"the dead letter at offset {offset}")
    return render(request, "confirm.html", title=f"Resend {what} of group {group}?",
                  action=f"/dlq/{quote(group, safe='')}/resend",
                  fields={"all": "yes" if every else "", "offset": "" if every else offset},
                  button="Resend", danger=False, back=back,
                  lines=[f"They go to %RETRY%{group}: only group {group} consumes them again, "
                         "and its consumers see the origin topic as the message's topic.",
                         "Each keeps its unique key and reconsume count: one that fails again "
                         "goes straight back to the dead-letter queue.",
                         "The dead-letter queue keeps its copies (it is append-only)."])


def routes() -> list[Route]:
    return [Route("/dlq", dlq_list, name="dlq_list"),
            Route("/dlq/{group}/resend", dlq_resend, methods=["POST"]),
            Route("/dlq/{group}", dlq_group, name="dlq")]
