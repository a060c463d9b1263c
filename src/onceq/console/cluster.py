"""Cluster: the broker groups of the console's broker's cluster, each group's leader, epoch
and members (role, lag, in sync), its load (queues held, bytes stored, write and consume
rates) and where the queues of the spread topics live (a topics x queues table coloured
by group, moving queues marked).

Built from the brokers alone: the console's broker answers ``BROKER_STATUS`` (a standalone
broker has no ``cluster`` section: the page says so) and ``LIST_TOPICS``; ``GET_ROUTE`` of
each topic gives its placement and, per group, its members and leader; each member's
``BROKER_STATUS`` gives its role and log end, the leader's its lags, ISR and counters.
Rates are taken between two views of the page (the live part refreshes every
``refresh_ms``), from the leaders' log end and ``counts``. The statuses, each group's load,
the member rows and the moving queues are made as ``onceq cluster status`` makes them
(``client/cluster_view.py``).

What the brokers cannot tell: the queues moving between groups (``moving`` of a route is
in etcd only), the groups holding no queue of a topic this broker knows, and the topics
with no queue on this broker's group. Given the cluster's etcd (``ConsoleConfig.cluster``,
``onceq console --cluster``, else ``ONCEQ_CLUSTER`` and ``ONCEQ_CLUSTER_NAME``), the page
reads the routes there as well: every spread topic, and the moving queues marked.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from ..client.cluster_view import Read, cluster_of, group_load, member_row, moves, read_statuses
from ..cluster import EtcdClient, EtcdError, TopicRoute, read_routes
from ..protocol.codes import SYSTEM_PREFIX
from ..protocol.replies import RouteInfo, StatusReply
from ..protocol.requests import BrokerStatus, GetRoute
from .access import PAGE_ERRORS, ConsoleAdmin
from .web import Console, console_of, failed, problem, render

# background colours of the groups in the placement table (then repeated)
ROUTE_READS = 16  # GET_ROUTE requests in flight while the page is made
PALETTE = ("#bfdbfe", "#bbf7d0", "#fde68a", "#fbcfe8", "#ddd6fe", "#fed7aa", "#a5f3fc",
           "#d9f99d", "#fecaca", "#e5e7eb")


@dataclass
class GroupFacts:
    """One group as the routes describe it: its leader's and members' addresses."""

    group: str
    leader_address: str | None = None
    members: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- the view (pure)
def member_rows(facts: GroupFacts, reads: dict[str, Read]) -> list[dict[str, Any]]:
    """Each member: broker id, role, log end, lag behind the leader, in sync."""
    lead = cluster_of(reads.get(facts.leader_address or ""))
    rows = []
    for address in sorted(set(facts.members) | ({facts.leader_address} - {None})):
        st = cluster_of(reads.get(address))
        rows.append(member_row(st.get("broker_id"), address, st, lead,
                               address == facts.leader_address and bool(st)))
    return sorted(rows, key=lambda r: (str(r["broker_id"]), r["address"]))


def build_view(here: str, facts: dict[str, GroupFacts], placement: dict[str, list[str]],
               moving: dict[str, list[tuple[int, str, str]]], reads: dict[str, Read],
               before: dict[str, Read]) -> dict[str, Any]:
    """What the page shows: ``here`` is the console's broker's group; ``placement`` the
    group of each queue of each spread topic; ``moving`` its queues moving (queue, to,
    phase); ``reads`` every broker's status by address, ``before`` the leaders' status at
    the previous view (for rates)."""
    names = sorted(set(facts) | {g for gs in placement.values() for g in gs} | {here})
    colour = {g: PALETTE[i % len(PALETTE)] for i, g in enumerate(names)}
    groups = []
    for name in names:
        f = facts.get(name, GroupFacts(name))
        lead = reads.get(f.leader_address or "")
        cl = cluster_of(lead)
        groups.append({"group": name, "colour": colour[name], "here": name == here,
                       "leader": cl.get("broker_id"), "leader_address": f.leader_address,
                       "epoch": cl.get("epoch"), "hw": cl.get("hw"),
                       "published_isr": cl.get("published_isr"),
                       "members": member_rows(f, reads),
                       "load": group_load(name, placement, moving,
                                          before.get(f.leader_address or ""), lead)})
    table = []
    for topic, gs in sorted(placement.items()):
        marks = {q: (to, phase) for q, to, phase in moving.get(topic, [])}
        table.append({"topic": topic, "queues": [
            {"queue": q, "group": g, "colour": colour[g], "moving": marks.get(q)}
            for q, g in enumerate(gs)]})
    rates = [g["load"]["sampled_s"] for g in groups if g["load"]["sampled_s"]]
    return {"here": here, "groups": groups, "placement": table,
            "width": max((len(gs) for gs in placement.values()), default=0),
            "moving": moves(placement, moving),
            "sampled_s": max(rates) if rates else None}


# ---------------------------------------------------------------- reading the brokers
async def _etcd_routes(c: Console) -> tuple[dict[str, TopicRoute] | None, str | None]:
    """The routes in etcd when the console has its endpoints (None: not configured)."""
    endpoints, name = c.cluster_etcd()
    if not endpoints:
        return None, None
    try:
        return await read_routes(EtcdClient(endpoints), name), None
    except (EtcdError, ValueError) as exc:
        return None, f"etcd at {endpoints}: {exc}"


async def gather(c: Console, admin: ConsoleAdmin) -> dict[str, Any]:
    """Read the cluster through the console's broker and make the view (None ``here``
    when the broker is standalone)."""
    status: StatusReply = await admin._call(BrokerStatus())
    own = status.cluster
    if not own:
        return {"standalone": True}
    here = str(own.get("group"))
    turns = asyncio.Semaphore(ROUTE_READS)

    async def route(name: str) -> RouteInfo:
        async with turns:
            return await admin._call(GetRoute(name))

    infos: list[RouteInfo] = []
    unrouted = []
    for info in await asyncio.gather(*(route(t["topic"]) for t in await admin.list_topics()
                                       if not t["topic"].startswith(SYSTEM_PREFIX))):
        if info.placement:
            infos.append(info)
        else:
            unrouted.append(info.topic)
    placement = {i.topic: [str(g) for g in i.placement] for i in infos}
    moving: dict[str, list[tuple[int, str, str]]] = {}
    etcd_routes, etcd_problem = await _etcd_routes(c)
    for topic, route in (etcd_routes or {}).items():
        placement[topic] = list(route.placement)
        if route.moving:
            moving[topic] = [tuple(m) for m in route.moving]  # type: ignore[misc]
    facts: dict[str, GroupFacts] = {}
    for info in infos:
        for g, d in info.groups.items():
            f = facts.setdefault(g, GroupFacts(g))
            f.leader_address = f.leader_address or d.get("leader")
            f.members = sorted(set(f.members) | set(d.get("members") or []))
    if here not in facts:  # no spread topic known here: its group from its own status
        leader = c.config.broker if own.get("role") == "leader" else own.get("leader")
        facts[here] = GroupFacts(here, leader, [c.config.broker])
    for g in {g for gs in placement.values() for g in gs} - set(facts):
        # a group of an etcd route that no route of this broker names: one GET_ROUTE
        info = await admin._call(GetRoute(next(t for t, gs in placement.items() if g in gs)))
        for name, d in info.groups.items():
            facts.setdefault(name, GroupFacts(name, d.get("leader"), list(d.get("members")
                                                                         or [])))
    addresses = sorted({a for f in facts.values()
                        for a in (*f.members, f.leader_address) if a})
    reads = await read_statuses(addresses, c.security)
    leaders = {f.leader_address for f in facts.values() if f.leader_address}
    before = dict(c.cluster_reads)
    c.cluster_reads = {a: r for a, r in reads.items() if a in leaders and r[1] is not None}
    view = build_view(here, facts, placement, moving, reads, before)
    view.update(standalone=False, unrouted=unrouted, etcd=etcd_routes is not None,
                etcd_problem=etcd_problem)
    return view


# ---------------------------------------------------------------- pages
async def cluster_page(request: Request) -> HTMLResponse:
    c = console_of(request)
    try:
        async with c.admin() as admin:
            view = await gather(c, admin)
    except PAGE_ERRORS as exc:
        return failed(request, exc, "cluster.html", view=None)
    return render(request, "cluster.html", view=view)


async def cluster_live(request: Request) -> HTMLResponse:
    """The page's live part alone (an open Cluster page refreshes it)."""
    c = console_of(request)
    try:
        async with c.admin() as admin:
            view = await gather(c, admin)
    except PAGE_ERRORS as exc:
        return render(request, "cluster_live.html", problem(request, exc).status,
                      error=problem(request, exc), view=None)
    return render(request, "cluster_live.html", view=view)


def routes() -> list[Route]:
    return [Route("/cluster", cluster_page, name="cluster"),
            Route("/live/cluster", cluster_live, name="cluster_live")]
