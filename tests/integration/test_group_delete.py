"""``onceq group delete`` (``DELETE_GROUP``): a consumer group's committed offsets are
forgotten, durably, and only when it has no live member; a member joining later starts it
afresh from its ``consume_from``."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from onceq import Admin, ErrorCode, Message, OnceqError, Producer, PullConsumer, PushConsumer
from tests.helpers import running_broker, wait_until
from tests.integration.test_cli import ok, run


class Seen:
    """Offsets delivered, recorded inside the listener."""

    def __init__(self) -> None:
        self.offsets: list[int] = []
        self._lock = threading.Lock()

    def __call__(self, msgs, ctx) -> None:
        with self._lock:
            self.offsets += [m.queue_offset for m in msgs]


async def _member(addr: str, seen: Seen) -> PushConsumer:
    """A member of group ``billing`` on topic ``T``, started, from the first offsets."""
    member = PushConsumer(addr, "billing", seen, consume_from="FIRST", commit_interval_s=0.1)
    member.subscribe("T")
    await member.start()
    return member


async def test_a_group_is_deleted_once_its_members_are_gone(tmp_path):
    data = str(tmp_path / "data")
    async with running_broker(data) as broker:
        addr = f"127.0.0.1:{broker.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 2)
        async with Producer(addr) as p:
            for q in (0, 1):
                await p.send_batch("T", [Message(b"m%d" % i) for i in range(5)], queue=q)
        seen = Seen()
        member = await _member(addr, seen)
        try:
            await wait_until(lambda: len(seen.offsets) == 10, 10, "first consumption")
            async with Admin(addr) as admin:
                with pytest.raises(OnceqError) as err:
                    await admin.delete_group("billing")
                assert err.value.code == ErrorCode.GROUP_ACTIVE
                assert member.client_id in err.value.message
        finally:
            await member.shutdown()  # commits its offsets, then leaves
        async with Admin(addr) as admin:
            assert "billing" in await admin.list_groups()
            assert await admin.delete_group("billing") == 2
            assert "billing" not in await admin.list_groups()
            for group in ("billing", "nobody"):
                with pytest.raises(OnceqError) as err:
                    await admin.delete_group(group)
                assert err.value.code == ErrorCode.GROUP_NOT_EXIST
            with pytest.raises(OnceqError) as err:
                await admin.delete_group("bad name!")
            assert err.value.code == ErrorCode.INVALID_NAME
        # a member of the group again: from the first message (no offset left)
        again = Seen()
        member = await _member(addr, again)
        try:
            await wait_until(lambda: len(again.offsets) == 10, 10, "consumed afresh")
        finally:
            await member.shutdown()
        assert sorted(again.offsets) == sorted(seen.offsets) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
        async with PullConsumer(addr, "audit") as c:  # (offsets of another group)
            await c.commit_offset("T", 0, 4)
        # the command line, in JSON
        out = json.loads(ok(await asyncio.to_thread(
            run, "group", "delete", "billing", "--json", "-b", addr)))
        assert out == {"group": "billing", "deleted": True, "queues": 2}
    async with running_broker(data) as broker:  # the deletion is in the log
        addr = f"127.0.0.1:{broker.port}"
        async with Admin(addr) as admin:
            assert await admin.list_groups() == ["audit"]
        failed = await asyncio.to_thread(run, "group", "delete", "billing", "-b", addr)
        assert failed.returncode == 2 and failed.stderr.startswith("error: GROUP_NOT_EXIST:")
