import os
import shutil
import uuid
from collections.abc import Iterator

import pytest

# Brokers started by the tests (and the demo's) must not depend on how full this host's
# disk is: the usage limit has its own tests, on a tmpfs of their own.
os.environ.setdefault("ONCEQ_DISK_MAX_USED_RATIO", "1.0")
# Some tests run the RocketMQ gRPC endpoint in this process; a process forked later (the
# Spark JVM's launcher) must not run gRPC's fork handlers (they restart its poller in the
# child, which then exits before it execs)
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from tests.cluster.group import start_etcd
from tests.helpers import running_broker

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
async def broker(tmp_path):
    async with running_broker(str(tmp_path / "data")) as b:
        yield b


@pytest.fixture
def addr(broker):
    return f"127.0.0.1:{broker.port}"


@pytest.fixture
async def fast_retry_addr(tmp_path):
    """A broker whose 18 retry delay levels are all 50 ms (a message retried through the
    retry topic comes back at once, not after RocketMQ's 10 s and more)."""
    async with running_broker(str(tmp_path / "data"),
                              delay_levels=" ".join(["50ms"] * 18)) as b:
        yield f"127.0.0.1:{b.port}"
