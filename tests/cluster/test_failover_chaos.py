"""The leader SIGKILLed 3 times under load (benchmarks/cluster_failover.py does it 20
times): nothing acknowledged lost, nothing stored twice, every business effect once, and
the replicas' logs equal up to the high watermark."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.cluster import chaos
from tests.cluster.group import Node

pytestmark = pytest.mark.timeout(90)


def test_leader_killed_under_load(group: list[Node], tmp_path: Path) -> None:
    result = asyncio.run(chaos.run(group, kills=3, work=tmp_path))
    print(result)
    assert result["acknowledged"] > 60, result
    assert result["lost"] == [], result
    assert result["stored_twice"] == [], result
    assert result["effects_not_once"] == [], result
    assert result["replicas_equal"] and result["compared_bytes"] > 0, result
    assert len(result["failover_s"]) == 3 and result["failover_max_s"] < 10, result
