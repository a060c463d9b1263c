"""The chaos run over two broker groups of three replicas (``spread_chaos.py``): lost
replies, members joining, a member SIGKILLed and one group's leader SIGKILLed, while
messages flow to a topic spread over both groups."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.cluster.group import make_group
from tests.cluster.spread_chaos import run

pytestmark = pytest.mark.timeout(240)


def test_chaos_over_two_groups_of_three(tmp_path: Path, etcd_endpoint: str,
                                        cluster_name: str) -> None:
    groups = {g: make_group(tmp_path / g, etcd_endpoint, cluster_name, 3, group=g)
              for g in ("g1", "g2")}
    work = tmp_path / "work"
    work.mkdir()
    try:
        out = asyncio.run(run(groups, work))
    finally:
        for ns in groups.values():
            for n in ns:
                n.kill()
    assert out["acknowledged"] > 100 and out["lost_replies"] > 10, out
    assert out["acked_after_leader_kill"] > 0, out
    assert out["lost"] == [], out
    assert out["stored_twice"] == [], out
    assert out["effects_not_once"] == [], out
    assert out["orderly"]["problem_count"] == 0, out["orderly"]
    print(f"spread chaos: { {k: v for k, v in out.items() if not isinstance(v, list)} }")
