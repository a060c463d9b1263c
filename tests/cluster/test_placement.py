"""A topic created with an explicit placement over broker groups (``onceq topic create
--placement`` / ``--groups``, ``Admin.create_topic(placement=...)``), and the clear
refusals: an unregistered group, a placement of the wrong length, another placement for a
topic that exists, a placement on a standalone broker."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from onceq.client.admin import Admin
from onceq.cluster import EtcdClient, read_route
from onceq.protocol.errors import ErrorCode, OnceqError
from tests.cluster.group import Node, leader_of, make_group
from tests.helpers import running_broker

pytestmark = pytest.mark.timeout(90)


def test_explicit_placement(tmp_path: Path, etcd_endpoint: str, cluster_name: str) -> None:
    groups = {g: make_group(tmp_path / g, etcd_endpoint, cluster_name, 1, "--min-insync",
                            "1", group=g) for g in ("g1", "g2")}
    nodes: list[Node] = [n for ns in groups.values() for n in ns]
    bootstrap = ",".join(n.address for n in nodes)

    async def go() -> None:
        for ns in groups.values():
            await leader_of(ns, timeout=20)
        etcd = EtcdClient(etcd_endpoint)
        async with Admin(bootstrap) as admin:
            await admin.create_topic("only2", 3, groups=["g2"])
            await admin.create_topic("mixed", 3, placement=["g2", "g2", "g1"])
            await admin.create_topic("mixed", 3, placement=["g2", "g2", "g1"])  # same: ok
            for bad, code in ((dict(placement=["g1", "g9", "g1"]), "not registered"),
                              (dict(placement=["g1", "g2", "g2"]), "another placement")):
                with pytest.raises(OnceqError) as refused:
                    await admin.create_topic("mixed" if "another" in code else "bad", 3,
                                             **bad)  # type: ignore[arg-type]
                assert refused.value.code == ErrorCode.INVALID_ARGUMENT
                assert code in refused.value.message
            with pytest.raises(ValueError):
                await admin.create_topic("short", 3, placement=["g1"])
        only2 = await read_route(etcd, cluster_name, "only2")
        mixed = await read_route(etcd, cluster_name, "mixed")
        assert only2 is not None and only2.placement == ("g2", "g2", "g2")
        assert mixed is not None and mixed.placement == ("g2", "g2", "g1")
        assert await read_route(etcd, cluster_name, "bad") is None

    try:
        asyncio.run(go())
        r = subprocess.run([sys.executable, "-m", "onceq.cli.main", "topic", "create", "cli",
                            "-q", "2", "--placement", "g1,g2", "--broker", bootstrap],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        route = asyncio.run(read_route(EtcdClient(etcd_endpoint), cluster_name, "cli"))
        assert route is not None and route.placement == ("g1", "g2")
    finally:
        for n in nodes:
            n.kill()


async def test_placement_on_a_standalone_broker_is_refused(tmp_path: Path) -> None:
    async with running_broker(str(tmp_path / "data")) as broker, \
            Admin(f"127.0.0.1:{broker.port}") as admin:
        with pytest.raises(OnceqError) as refused:
            await admin.create_topic("t", 2, placement=["g1", "g2"])
        assert refused.value.code == ErrorCode.INVALID_ARGUMENT
        assert "not in a cluster" in refused.value.message
        await admin.create_topic("t", 2)  # without: as always
