"""Broker groups for the cluster tests (the etcd they register with: ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.group import Node, make_group


@pytest.fixture
def group(tmp_path: Path, etcd_endpoint: str, cluster_name: str) -> Iterator[list[Node]]:
    nodes = make_group(tmp_path, etcd_endpoint, cluster_name)
    try:
        yield nodes
    finally:
        for n in nodes:
            n.kill()


@pytest.fixture
def unclean_group(tmp_path: Path, etcd_endpoint: str, cluster_name: str
                  ) -> Iterator[list[Node]]:
    """A group whose elections are unclean (``--unclean-election``): any replica may lead."""
    nodes = make_group(tmp_path, etcd_endpoint, cluster_name, 3, "--unclean-election")
    try:
        yield nodes
    finally:
        for n in nodes:
            n.kill()
