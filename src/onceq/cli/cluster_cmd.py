"""``onceq cluster status``, ``onceq cluster drain`` and ``onceq topic reassign``: the
broker groups of a cluster as etcd and their leaders see
them: each group's leader and epoch, the in-sync replicas published in etcd, and each
member with its log end, its lag behind the leader and whether it is in sync (from the
leader's ``BROKER_STATUS``, whose ``cluster`` section carries the ISR and the lags).

Per group its load: the queues the routes place on it, its leader's stored bytes and,
from two reads of the leader's status ``--sample-s`` apart, the bytes written and the
messages stored and consumed per second (``BROKER_STATUS``'s ``counts``). ``build_view``
makes the view from what was read, without I/O, from the pieces the console's Cluster page
shares (``client/cluster_view.py``: the statuses read, a group's load, a member's row)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ..client.cluster_view import Read, cluster_of, group_load, member_row, moves, read_statuses
from ..client.reassign import drain_group, reassign
from ..client.security import ClientSecurity, CredentialsError
from ..cluster import (
    EtcdClient,
    EtcdError,
    TopicRoute,
    current_leader,
    members,
    read_isr,
    read_routes,
)
from ..cluster._keys import ROOT, check_name
from ..protocol.errors import OnceqError
from .common import async_command, fail


@dataclass
class GroupFacts:
    """One broker group as etcd (or the routes the brokers answer) describes it, before its
    brokers are asked for their status."""

    group: str
    leader: str | None = None  # the leader's broker id
    leader_address: str | None = None
    epoch: int | None = None
    published_isr: list[str] | None = None
    isr_epoch: int | None = None
    members: dict[str, str] = field(default_factory=dict)  # broker id -> address


async def sample_leaders(facts: list[GroupFacts], sample_s: float,
                         first: dict[str, Read], security: ClientSecurity | None = None
                         ) -> dict[str, Read]:
    """The leaders' status read again ``sample_s`` seconds after ``first`` (nothing for 0)."""
    leaders = [f.leader_address for f in facts if f.leader_address]
    if sample_s <= 0 or not leaders:
        return {}
    read_at = [first[a][0] for a in leaders if a in first]
    wait = sample_s - (time.monotonic() - min(read_at)) if read_at else sample_s
    if wait > 0:
        await asyncio.sleep(wait)
    return await read_statuses(leaders, security)


# ---------------------------------------------------------------- the view (pure)
def route_doc(route: TopicRoute) -> dict[str, Any]:
    """A route as the view shows it: queues, placement, queues per group, moving queues."""
    return {"queues": route.queues, "placement": list(route.placement),
            "by_group": {g: route.queues_of(g) for g in route.groups},
            "version": route.version, "moving": [list(m) for m in route.moving]}


def member_rows(facts: GroupFacts, reads: dict[str, Read]) -> list[dict[str, Any]]:
    """Each member of a group: its role, log end, high watermark, lag behind the leader
    (bytes) and whether it is in sync, as its own status and its leader's tell."""
    lead = cluster_of(reads.get(facts.leader_address or ""))
    return [member_row(bid, address, cluster_of(reads.get(address)), lead,
                       facts.leader is not None and bid == facts.leader)
            for bid, address in sorted(facts.members.items())]


def build_view(cluster: str, etcd: dict[str, Any], facts: list[GroupFacts],
               routes: dict[str, TopicRoute], reads: dict[str, Read],
               second: dict[str, Read] | None = None,
               sample_s: float = 0.0) -> dict[str, Any]:
    """Everything ``onceq cluster status`` shows, from what was read: the groups as etcd
    knows them, the routes, each broker's status (``reads``, by address) and the leaders'
    status read again (``second``)."""
    docs = {t: route_doc(r) for t, r in sorted(routes.items())}
    placement = {t: d["placement"] for t, d in docs.items()}
    moving = {t: d["moving"] for t, d in docs.items() if d["moving"]}
    groups = []
    for f in sorted(facts, key=lambda f: f.group):
        lead = reads.get(f.leader_address or "")
        again = (second or {}).get(f.leader_address or "")
        # rates between the two reads of the leader; its first read alone when the second
        # was not taken or did not reach it
        before, now = (lead, again) if again is not None and again[1] is not None \
            else (None, lead)
        groups.append({"group": f.group, "leader": f.leader,
                       "leader_address": f.leader_address, "epoch": f.epoch,
                       "hw": cluster_of(lead).get("hw"), "published_isr": f.published_isr,
                       "isr_epoch": f.isr_epoch, "members": member_rows(f, reads),
                       "load": group_load(f.group, placement, moving, before, now)})
    return {"cluster": cluster, "etcd": etcd, "sample_s": sample_s, "groups": groups,
            "routes": docs, "moving": moves(placement, moving)}


# ---------------------------------------------------------------- reading etcd
async def _groups(client: EtcdClient, cluster: str) -> list[str]:
    prefix = f"{ROOT}/{check_name('cluster', cluster)}/".encode()
    kvs, _ = await client.range(prefix, prefix=True)
    names = set()
    for kv in kvs:
        parts = kv.key[len(prefix):].decode(errors="replace").split("/")
        if len(parts) >= 2 and parts[0] in ("groups", "brokers"):
            names.add(parts[1])
    return sorted(names)


async def group_facts(client: EtcdClient, cluster: str) -> list[GroupFacts]:
    """Every group registered in etcd: its leader, epoch, published ISR and members."""
    out = []
    for name in await _groups(client, cluster):
        leader, epoch = await current_leader(client, cluster, name)
        isr = await read_isr(client, cluster, name)
        found = await members(client, cluster, name)
        out.append(GroupFacts(
            name, None if leader is None else leader.broker_id,
            None if leader is None else leader.address, epoch,
            None if isr is None else list(isr.members), None if isr is None else isr.epoch,
            {bid: m.address for bid, m in found.by_id.items()}))
    return out


async def cluster_view(endpoints: str, cluster: str, sample_s: float = 0.0,
                       security: ClientSecurity | None = None) -> dict[str, Any]:
    """Everything ``onceq cluster status`` shows, as one JSON-able dict; with ``sample_s``
    > 0 the leaders are read twice, that many seconds apart, for their rates."""
    client = EtcdClient(endpoints)
    try:
        health = await client.call("maintenance/status", {})
        etcd = {"healthy": True, "version": health.get("version"),
                "leader": health.get("leader")}
    except EtcdError as exc:
        return {"cluster": cluster, "etcd": {"healthy": False, "error": str(exc)},
                "sample_s": sample_s, "groups": [], "routes": {}, "moving": []}
    facts = await group_facts(client, cluster)
    routes = await read_routes(client, cluster)
    addresses = [a for f in facts for a in (*f.members.values(), f.leader_address) if a]
    reads = await read_statuses(addresses, security)
    second = await sample_leaders(facts, sample_s, reads, security)
    return build_view(cluster, etcd, facts, routes, reads, second, sample_s)


# ---------------------------------------------------------------- printing
def human_bytes(n: float | None) -> str:
    """1536 -> "1.5 KiB"; None -> "-"."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _rate(v: float | None, unit: str = "/s") -> str:
    return "-" if v is None else f"{v:,.1f}{unit}"


def _print(view: dict[str, Any]) -> None:
    console = Console()
    etcd = view["etcd"]
    console.print(f"cluster {view['cluster']}: etcd "
                  + ("healthy" if etcd["healthy"] else f"UNREACHABLE ({etcd['error']})"))
    if not view["groups"]:
        console.print("no broker group registered")
    for g in view["groups"]:
        leader = g["leader"] or "none (an election is going on, or no replica may lead)"
        console.print(f"\ngroup {g['group']}: leader {leader}, epoch {g['epoch']}, high "
                      f"watermark {g['hw']}, published ISR "
                      f"{', '.join(g['published_isr'] or []) or '-'}")
        table = Table("broker", "address", "role", "log end", "lag (bytes)", "in sync")
        for m in g["members"]:
            table.add_row(m["broker_id"], m["address"], m["role"], str(m["log_end"]),
                          "-" if m["lag"] is None else str(m["lag"]),
                          "yes" if m["in_sync"] else "no")
        console.print(table)
    if view["groups"]:
        sampled = view.get("sample_s") or 0
        table = Table("group", "queues", "moving out/in", "stored", "written",
                      "messages in", "consumed",
                      title="load per group (leader's log; rates over "
                            f"{sampled:g} s)" if sampled else
                            "load per group (leader's log; no rate: --sample-s 0)")
        for g in view["groups"]:
            ld = g["load"]
            table.add_row(g["group"], str(ld["queues"]),
                          f"{ld['moving_out']}/{ld['moving_in']}", human_bytes(ld["bytes"]),
                          "-" if ld["write_bytes_s"] is None
                          else f"{human_bytes(ld['write_bytes_s'])}/s",
                          _rate(ld["write_msgs_s"], " msg/s"),
                          _rate(ld["consume_msgs_s"], " msg/s"))
        console.print(table)
    if view.get("routes"):
        table = Table("topic", "queues", "placement (group: queues)",
                      title="topics spread over groups")
        for topic, r in view["routes"].items():
            table.add_row(topic, str(r["queues"]), "; ".join(
                f"{g}: {_ranges(qs)}" for g, qs in r["by_group"].items()))
        console.print(table)
    if view.get("moving"):
        table = Table("topic", "queue", "from", "to", "phase", title="queues moving")
        for m in view["moving"]:
            table.add_row(m["topic"], str(m["queue"]), m["from"], m["to"], m["phase"])
        console.print(table)


def _ranges(queues: list[int]) -> str:
    """[0, 2, 4] -> "0, 2, 4"; [0, 1, 2, 5] -> "0-2, 5"."""
    out: list[str] = []
    for q in queues:
        if out and out[-1].split("-")[-1] == str(q - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{q}"
        else:
            out.append(str(q))
    return ", ".join(out)


def _etcd_options(fn: Any) -> Any:
    fn = click.option("--cluster", "endpoints", required=True, envvar="ONCEQ_CLUSTER",
                      help="etcd endpoints, etcd://host:port[,host:port...]")(fn)
    fn = click.option("--cluster-name", default="onceq", show_default=True,
                      envvar="ONCEQ_CLUSTER_NAME", help="Name of the cluster in etcd.")(fn)
    fn = click.option("--drain-timeout", default=30.0, show_default=True, type=float,
                      help="Seconds the consumer groups get to consume a sealed queue to "
                           "its end before it is handed over.")(fn)
    return click.option("--json", "as_json", is_flag=True, help="Print JSON.")(fn)


async def _moving(work: Any, as_json: bool) -> None:
    try:
        done = await work(say=(lambda _: None) if as_json else click.echo)
    except OnceqError as exc:
        fail(f"{exc.code.name}: {exc.message}")
    except (ValueError, EtcdError) as exc:
        fail(str(exc))
    if as_json:
        click.echo(json.dumps(done, indent=2))


def register(main: click.Group) -> None:
    @main.group()
    def cluster() -> None:
        """Broker groups replicated through etcd (docs/cluster.md)."""

    @click.command("reassign")
    @click.argument("topic")
    @click.argument("queue", type=click.IntRange(0))
    @click.option("--to", "to", required=True, help="The broker group the queue moves to.")
    @_etcd_options
    @async_command
    async def reassign_cmd(topic: str, queue: int, to: str, endpoints: str,
                           cluster_name: str, drain_timeout: float, as_json: bool) -> None:
        """Move QUEUE of TOPIC to another broker group under load: sealed for sends, its
        messages copied with their offsets, its consumers drained, then switched
        (docs/cluster.md, "Moving a queue to another group"). Run it again to finish a
        move that was interrupted."""
        await _moving(lambda say: reassign(endpoints, cluster_name, topic, queue, to,
                                           security=ClientSecurity.from_env(),
                                           drain_timeout=drain_timeout, say=say), as_json)

    main.commands["topic"].add_command(reassign_cmd)  # type: ignore[attr-defined]

    @cluster.command("drain")
    @click.argument("group")
    @_etcd_options
    @async_command
    async def drain(group: str, endpoints: str, cluster_name: str, drain_timeout: float,
                    as_json: bool) -> None:
        """Move every queue of broker GROUP to the other groups, before removing it."""
        await _moving(lambda say: drain_group(endpoints, cluster_name, group,
                                              security=ClientSecurity.from_env(),
                                              drain_timeout=drain_timeout, say=say),
                      as_json)

    @cluster.command("status")
    @click.option("--cluster", "endpoints", required=True, envvar="ONCEQ_CLUSTER",
                  help="etcd endpoints, etcd://host:port[,host:port...]")
    @click.option("--cluster-name", default="onceq", show_default=True,
                  envvar="ONCEQ_CLUSTER_NAME", help="Name of the cluster in etcd.")
    @click.option("--sample-s", default=1.0, show_default=True, type=click.FloatRange(0, 60),
                  help="Seconds between the two reads of each leader's status the rates "
                       "are measured over (0: no rate).")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON.")
    @async_command
    async def status(endpoints: str, cluster_name: str, sample_s: float,
                     as_json: bool) -> None:
        """Groups, leaders, epochs, members with their log end, lag and in-sync state; per
        group its load (queues held, bytes stored, write and consume rates); the routes
        and the queues moving between groups."""
        try:
            view = await cluster_view(endpoints, cluster_name, sample_s,
                                      ClientSecurity.from_env())
        except (ValueError, CredentialsError) as exc:
            fail(str(exc))
        if as_json:
            click.echo(json.dumps(view, indent=2))
        else:
            _print(view)
        if not view["etcd"]["healthy"]:
            raise SystemExit(3)
