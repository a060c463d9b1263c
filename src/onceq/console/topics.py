"""Topics: the list (queues, offsets, last store time), one topic's queues, create, and
delete after a confirmation step."""

from __future__ import annotations

from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from ..protocol.codes import SYSTEM_PREFIX
from . import forms
from .access import PAGE_ERRORS
from .web import Refused, console_of, failed, mutation_form, refused, render


async def topic_list(request: Request) -> HTMLResponse:
    c = console_of(request)
    system = request.query_params.get("system") == "1"
    rows = []
    try:
        async with c.admin() as admin:
            for t in await admin.list_topics():
                name = t["topic"]
                if name.startswith(SYSTEM_PREFIX) and not system:
                    continue
                queues = await admin.topic_status(name)
                last = [q["last_store_ms"] for q in queues if q["last_store_ms"] is not None]
                rows.append({"topic": name, "queues": len(queues),
                             "min": sum(q["min"] for q in queues),
                             "max": sum(q["max"] for q in queues),
                             "messages": sum(q["max"] - q["min"] for q in queues),
                             "last_store_ms": max(last) if last else None})
    except PAGE_ERRORS as exc:
        return failed(request, exc, "topics.html", rows=[], system=system)
    return render(request, "topics.html", rows=rows, system=system,
                  notice=request.query_params.get("notice"))


async def topic_create(request: Request) -> Response:
    c = console_of(request)
    try:
        form = await mutation_form(request)
    except Refused as exc:
        return refused(request, exc)
    try:
        name = forms.text(form.get("name"), "topic name")  # type: ignore[arg-type]
        queues = forms.integer(form.get("queues"), "queues", low=1,  # type: ignore[arg-type]
                               high=1024)
        async with c.admin() as admin:
            t = await admin.create_topic(name, queues)
    except PAGE_ERRORS as exc:
        return failed(request, exc, "topics.html", rows=[], system=False)
    notice = f"topic {t['topic']}: {t['queues']} queues"
    return RedirectResponse(f"/topics?notice={quote(notice)}", status_code=303)


async def topic_page(request: Request) -> HTMLResponse:
    c = console_of(request)
    name = request.path_params["topic"]
    try:
        async with c.admin() as admin:
            queues = await admin.topic_status(name)
    except PAGE_ERRORS as exc:
        return failed(request, exc, "topic.html", topic=name, queues=[])
    return render(request, "topic.html", topic=name, queues=queues)


async def topic_delete(request: Request) -> Response:
    """First post: the confirmation page. Second post (``confirm=yes``): the delete."""
    c = console_of(request)
    name = request.path_params["topic"]
    try:
        form = await mutation_form(request)
    except Refused as exc:
        return refused(request, exc)
    try:
        async with c.admin() as admin:
            queues = await admin.topic_status(name)
            if form.get("confirm") != "yes":
                return render(request, "confirm.html", title=f"Delete topic {name}?",
                              action=f"/topics/{quote(name, safe='')}/delete",
                              fields={}, button="Delete the topic", danger=True,
                              lines=[f"{len(queues)} queue(s) and "
                                     f"{sum(q['max'] - q['min'] for q in queues):,} message(s)"
                                     " will be deleted with their indexes.",
                                     "Consumer groups' offsets on it are left as they are."],
                              back=f"/topics/{quote(name, safe='')}")
            await admin.delete_topic(name)
    except PAGE_ERRORS as exc:
        return failed(request, exc, "topic.html", topic=name, queues=[])
    return RedirectResponse(f"/topics?notice={quote(f'topic {name} deleted')}",
                            status_code=303)


def routes() -> list[Route]:
    return [Route("/topics", topic_list, name="topics"),
            Route("/topics", topic_create, methods=["POST"]),
            Route("/topics/{topic:path}/delete", topic_delete, methods=["POST"]),
            Route("/topics/{topic:path}", topic_page, name="topic")]
