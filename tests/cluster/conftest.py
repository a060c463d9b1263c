"""A private etcd for the cluster tests: one process per test session, on free loopback
ports, with its data in a temporary directory, killed at the end.

Without an ``etcd`` binary the tests that need it are skipped, except in CI (``CI=true``),
where that is a failure: ``scripts/etcd.sh`` installs it (Debian's ``etcd-server``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.group import Node, make_group, start_etcd

MISSING = "etcd is not installed (bash scripts/etcd.sh installs Debian's etcd-server)"


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``127.0.0.1:PORT`` of a single-member etcd started for this test session."""
    binary = shutil.which("etcd")
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{MISSING}; CI must run the cluster tests", pytrace=False)
        pytest.skip(MISSING)
    try:
        with start_etcd(binary, tmp_path_factory.mktemp("etcd")) as endpoint:
            yield endpoint
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def cluster_name() -> str:
    """A cluster name of its own per test, so tests never see each other's keys."""
    return f"t{uuid.uuid4().hex[:12]}"


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
