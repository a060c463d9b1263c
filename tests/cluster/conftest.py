"""A private etcd for the cluster tests: one process per test session, on free loopback
ports, with its data in a temporary directory, killed at the end.

Without an ``etcd`` binary the tests that need it are skipped, except in CI (``CI=true``),
where that is a failure: ``scripts/etcd.sh`` installs it (Debian's ``etcd-server``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import free_port

MISSING = "etcd is not installed (bash scripts/etcd.sh installs Debian's etcd-server)"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as answer:
            return b'"true"' in answer.read()
    except OSError:
        return False


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``127.0.0.1:PORT`` of a single-member etcd started for this test session."""
    binary = shutil.which("etcd")
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{MISSING}; CI must run the cluster tests", pytrace=False)
        pytest.skip(MISSING)
    data: Path = tmp_path_factory.mktemp("etcd")
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    log = (data / "etcd.log").open("wb")
    # heartbeat 50 ms / election 500 ms: etcd's shortest lease is then 1 s (not 2 s)
    proc = subprocess.Popen(
        [binary, "--name", "onceq-test", "--data-dir", str(data / "member"),
         "--listen-client-urls", client, "--advertise-client-urls", client,
         "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"onceq-test={peer}", "--initial-cluster-state", "new",
         "--heartbeat-interval", "50", "--election-timeout", "500",
         "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not _healthy(client):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (data / "etcd.log").read_text(errors="replace")[-2000:]
                pytest.fail(f"etcd did not become healthy at {client}:\n{tail}", pytrace=False)
            time.sleep(0.05)
        yield client.removeprefix("http://")
    finally:
        proc.kill()
        proc.wait()
        log.close()


@pytest.fixture
def cluster_name() -> str:
    """A cluster name of its own per test, so tests never see each other's keys."""
    return f"t{uuid.uuid4().hex[:12]}"
