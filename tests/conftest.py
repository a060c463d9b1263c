import pytest

from tests.helpers import running_broker


@pytest.fixture
async def broker(tmp_path):
    async with running_broker(str(tmp_path / "data")) as b:
        yield b


@pytest.fixture
def addr(broker):
    return f"127.0.0.1:{broker.port}"
