"""``onceq cluster status``, ``onceq cluster drain`` and ``onceq topic reassign``: the
broker groups of a cluster as etcd and their leaders see
them: each group's leader and epoch, the in-sync replicas published in etcd, and each
member with its log end, its lag behind the leader and whether it is in sync (from the
leader's ``BROKER_STATUS``, whose ``cluster`` section carries the ISR and the lags)."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ..client.reassign import drain_group, reassign
from ..client.route import cluster_status
from ..client.security import ClientSecurity
from ..cluster import EtcdClient, EtcdError, current_leader, members, read_isr, read_routes
from ..cluster._keys import ROOT, check_name
from ..protocol.errors import OnceqError
from .common import async_command, fail


async def _status(address: str) -> dict[str, Any] | None:
    return await cluster_status(address, timeout=2.0)


async def _groups(client: EtcdClient, cluster: str) -> list[str]:
    prefix = f"{ROOT}/{check_name('cluster', cluster)}/".encode()
    kvs, _ = await client.range(prefix, prefix=True)
    names = set()
    for kv in kvs:
        parts = kv.key[len(prefix):].decode(errors="replace").split("/")
        if len(parts) >= 2 and parts[0] in ("groups", "brokers"):
            names.add(parts[1])
    return sorted(names)


async def cluster_view(endpoints: str, cluster: str) -> dict[str, Any]:
    """Everything ``onceq cluster status`` shows, as one JSON-able dict."""
    client = EtcdClient(endpoints)
    try:
        health = await client.call("maintenance/status", {})
        etcd = {"healthy": True, "version": health.get("version"),
                "leader": health.get("leader")}
    except EtcdError as exc:
        return {"cluster": cluster, "etcd": {"healthy": False, "error": str(exc)},
                "groups": []}
    groups = []
    for name in await _groups(client, cluster):
        leader, epoch = await current_leader(client, cluster, name)
        isr = await read_isr(client, cluster, name)
        found = await members(client, cluster, name)
        lead_st = await _status(leader.address) if leader is not None else None
        lags = (lead_st or {}).get("lag") or {}
        in_sync = set((lead_st or {}).get("isr") or [])
        rows = []
        for bid, m in sorted(found.by_id.items()):
            st = lead_st if leader is not None and bid == leader.broker_id else \
                await _status(m.address)
            rows.append({"broker_id": bid, "address": m.address,
                         "role": (st or {}).get("role", "unreachable"),
                         "log_end": (st or {}).get("log_end"),
                         "hw": (st or {}).get("hw"),
                         "lag": 0 if leader is not None and bid == leader.broker_id
                         else lags.get(bid),
                         "in_sync": bid in in_sync})
        groups.append({"group": name, "leader": None if leader is None else leader.broker_id,
                       "leader_address": None if leader is None else leader.address,
                       "epoch": epoch,
                       "hw": (lead_st or {}).get("hw"),
                       "published_isr": None if isr is None else list(isr.members),
                       "isr_epoch": None if isr is None else isr.epoch,
                       "members": rows})
    routes = {t: {"queues": r.queues, "placement": list(r.placement),
                  "by_group": {g: r.queues_of(g) for g in r.groups}}
              for t, r in sorted((await read_routes(client, cluster)).items())}
    return {"cluster": cluster, "etcd": etcd, "groups": groups, "routes": routes}


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
    if view.get("routes"):
        table = Table("topic", "queues", "placement (group: queues)",
                      title="topics spread over groups")
        for topic, r in view["routes"].items():
            table.add_row(topic, str(r["queues"]), "; ".join(
                f"{g}: {_ranges(qs)}" for g, qs in r["by_group"].items()))
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
    @click.option("--json", "as_json", is_flag=True, help="Print JSON.")
    @async_command
    async def status(endpoints: str, cluster_name: str, as_json: bool) -> None:
        """Groups, leaders, epochs, members with their log end, lag and in-sync state."""
        try:
            view = await cluster_view(endpoints, cluster_name)
        except ValueError as exc:
            fail(str(exc))
        if as_json:
            click.echo(json.dumps(view, indent=2))
        else:
            _print(view)
        if not view["etcd"]["healthy"]:
            raise SystemExit(3)
