import os

import pytest

# Brokers started by the tests (and the demo's) must not depend on how full this host's
# disk is: the usage limit has its own tests, on a tmpfs of their own.
os.environ.setdefault("ONCEQ_DISK_MAX_USED_RATIO", "1.0")

from tests.helpers import running_broker


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
