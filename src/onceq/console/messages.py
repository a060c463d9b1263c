"""Messages: look one up by unique key or business key (where it is stored, which groups
consumed it, its copies in the groups' retry and dead-letter topics, its records in the
idempotency layer's store when the console was given one), and browse a queue by offset
range."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from ..protocol.codes import (
    PROP_DLQ_REASON,
    PROP_ORIGIN_TOPIC,
    PullStatus,
    dlq_topic,
    retry_topic,
)
from ..protocol.errors import ErrorCode, OnceqError
from . import forms
from .access import PAGE_ERRORS, ConsoleAdmin
from .web import console_of, failed, render

MAX_BROWSE = 200
BODY_PREVIEW = 300


def preview(body: bytes, n: int = BODY_PREVIEW) -> str:
    text = body[:n * 4].decode("utf-8", errors="replace")
    return text if len(text) <= n else text[:n] + "…"


async def _consumed_by(admin: ConsoleAdmin, groups: list[str], topic: str, queue: int,
                       offset: int) -> list[dict[str, Any]]:
    """Every group with a committed offset on the message's queue, and whether it is past
    the message (the group consumed it)."""
    out = []
    for g in groups:
        committed = await admin.group_offset(g, topic, queue)
        if committed is not None:
            out.append({"group": g, "committed": committed, "consumed": committed > offset})
    return out


async def _copies(admin: ConsoleAdmin, topics: set[str], groups: list[str], unique_key: str,
                  origin: str) -> list[dict[str, Any]]:
    """The message's copies in each group's retry and dead-letter topics (a message
    keeps its unique key when it is retried, dead-lettered or resent)."""
    out = []
    for g in groups:
        for kind, t in (("retry", retry_topic(g)), ("dead letter", dlq_topic(g))):
            if t not in topics:
                continue
            try:
                res = await admin.query_message(t, unique_key, by="unique")
            except OnceqError as exc:
                if exc.code in (ErrorCode.MESSAGE_NOT_FOUND, ErrorCode.TOPIC_NOT_EXIST):
                    continue
                raise
            for m in res["messages"]:
                props = m.get("properties") or {}
                if props.get(PROP_ORIGIN_TOPIC, origin) != origin:
                    continue
                out.append({"group": g, "kind": kind, "topic": t, "queue": m["queue"],
                            "offset": m["offset"], "store_ms": m["store_ms"],
                            "reconsume": m["reconsume"],
                            "reason": props.get(PROP_DLQ_REASON, "")})
    return out


async def _dedup_records(url: str, groups: list[str], topic: str, keys: list[str]
                         ) -> list[dict[str, Any]]:
    from ..idempotency import StoreError, find_records

    try:
        records = await find_records(url, groups, topic, keys)
    except (ValueError, StoreError) as exc:
        raise forms.InputError(f"dedup store: {exc}") from None
    return [{"group": rec.group, "key": rec.key, "status": rec.status.value,
             "owner": rec.owner, "attempt": rec.attempt,
             "updated_ms": int(rec.updated_at * 1000),
             "expires_ms": int(rec.expires_at * 1000)} for rec in records]


async def lookup(request: Request) -> HTMLResponse:
    c = console_of(request)
    p = request.query_params
    q = {k: p.get(k, "") for k in ("topic", "key", "by", "begin", "end")}
    q["by"] = q["by"] or "unique"
    q["history"] = "" if p.get("nohistory") == "1" else "1"
    ctx: dict[str, Any] = {"q": q, "found": None, "dedup_store": c.config.dedup_store}
    if not p.get("key"):
        return render(request, "messages.html", **ctx)
    try:
        topic = forms.text(q["topic"], "topic")
        key = forms.text(q["key"], "key")
        by = forms.choice(q["by"], "look up by", ("unique", "keys"))
        begin = forms.optional_time_ms(q["begin"], "from")
        end = forms.optional_time_ms(q["end"], "to")
        async with c.admin() as admin:
            try:
                res = await admin.query_message(topic, key, by=by, begin_ms=begin, end_ms=end,
                                                max_results=50)
            except OnceqError as exc:
                if exc.code != ErrorCode.MESSAGE_NOT_FOUND:
                    raise
                res = {"messages": [], "scanned": None, "truncated": False}
            groups = [g for g in await admin.list_groups() if not g.startswith("%")]
            topics = {t["topic"] for t in await admin.list_topics()}
            for m in res["messages"]:
                m["consumed_by"] = await _consumed_by(admin, groups, topic, m["queue"],
                                                      m["offset"])
                m["copies"] = (await _copies(admin, topics, groups, m["unique_key"], topic)
                               if q["history"] else [])
                if c.config.dedup_store:
                    keys = list(dict.fromkeys([m["unique_key"], *m["keys"].split()]))
                    m["dedup"] = await _dedup_records(
                        c.config.dedup_store, [g["group"] for g in m["consumed_by"]], topic,
                        keys)
    except PAGE_ERRORS as exc:
        return failed(request, exc, "messages.html", **ctx)
    ctx["found"] = res
    return render(request, "messages.html", **ctx)


async def browse(request: Request) -> HTMLResponse:
    c = console_of(request)
    p = request.query_params
    q = {k: p.get(k, "") for k in ("topic", "queue", "offset", "count")}
    q["count"] = q["count"] or "20"
    q["queue"] = q["queue"] or "0"
    ctx: dict[str, Any] = {"q": q, "read": None}
    if not q["topic"]:
        return render(request, "browse.html", **ctx)
    try:
        topic = forms.text(q["topic"], "topic")
        queue = forms.integer(q["queue"], "queue", high=(1 << 31) - 1)
        offset = forms.optional_integer(q["offset"], "from offset")
        count = forms.integer(q["count"], "count", low=1, high=MAX_BROWSE)
        async with c.admin() as admin:
            n = await admin.queue_count(topic)
            if queue >= n:
                raise forms.InputError(f"queue: topic {topic} has queues 0..{n - 1}")
            lo, hi = await admin.queue_offsets(topic, queue)
            start = lo if offset is None else offset
            if start > hi:
                raise forms.InputError(f"from offset: {start} is past the end of "
                                       f"{topic}[{queue}] (offsets {lo}..{hi - 1})")
            read = await admin.read_queue(topic, queue, max(start, lo), count)
    except PAGE_ERRORS as exc:
        return failed(request, exc, "browse.html", **ctx)
    rows = [{"offset": m.queue_offset, "unique_key": m.unique_key, "keys": m.keys,
             "tags": m.tags, "store_ms": m.store_ts_ms, "reconsume": m.reconsume_times,
             "size": len(m.body), "body": preview(m.body),
             "properties": m.properties} for m in read.messages]
    notes = []
    if offset is not None and offset < lo:
        notes.append(f"offsets below {lo} are gone (retention): reading from {lo}")
    if read.status == PullStatus.DAMAGED:
        notes.append(f"offsets {start}..{read.next_offset - 1} were lost to disk damage")
    ctx.update(read={"rows": rows, "min": lo, "max": hi, "next": read.next_offset,
                     "start": max(start, lo), "notes": notes,
                     "prev": max(lo, max(start, lo) - count)},
               topic=topic, queue=queue, count=count)
    return render(request, "browse.html", **ctx)


def routes() -> list[Route]:
    return [Route("/messages", lookup, name="messages"),
            Route("/messages/browse", browse, name="browse")]
