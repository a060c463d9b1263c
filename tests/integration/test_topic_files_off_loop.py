"""Creating a topic of many queues makes its index directories in a thread, and deleting
one removes its files in a thread: other requests are answered meanwhile, and the topic is
whole when its answer comes."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from onceq import Admin, OnceqError, Producer, PullConsumer
from onceq.protocol.codes import RequestCode
from onceq.protocol.errors import ErrorCode
from onceq.protocol.frame import REQUEST, encode_frame
from tests.helpers import running_broker, wait_until
from tests.integration.test_bad_input import Raw


async def test_a_large_topic_is_created_while_other_requests_are_answered(tmp_path):
    async with running_broker(str(tmp_path / "d")) as b:
        raw = await Raw.open(b.port)
        try:
            await raw.write(encode_frame(REQUEST, RequestCode.CREATE_TOPIC, 1,
                                         {"topic": "big", "queues": 1000})
                            + encode_frame(REQUEST, RequestCode.PING, 2))
            first = await raw.read_frame()
            second = await raw.read_frame()
        finally:
            await raw.close()
        # the ping, sent after the create, is answered first: the loop did not wait
        assert [(f[0], f[1]) for f in (first, second)] == [(0, 2), (0, 1)]
        assert second[2] == {"topic": "big", "queues": 1000}
        addr = f"127.0.0.1:{b.port}"
        async with Producer(addr) as p:
            r = await p.send("big", b"x", queue=999)
        async with PullConsumer(addr, "g") as c:
            got = await c.pull("big", 999, 0, 10)
        assert [m.body for m in got.messages] == [b"x"] and r.offset == 0


async def test_a_deleted_topics_files_go_and_its_name_is_free_at_once(tmp_path):
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        queues_dir = os.path.join(str(tmp_path / "d"), "queues")
        async with Admin(addr) as admin:
            await admin.create_topic("gone", 200)
            async with Producer(addr) as p:
                await p.send("gone", b"old", queue=3)
            await admin.delete_topic("gone")
            await admin.create_topic("gone", 4)  # the name is free at once
            async with Producer(addr) as p:
                r = await p.send("gone", b"new", queue=3)
            assert r.offset == 0  # a new topic: nothing of the old one
        await wait_until(lambda: os.listdir(queues_dir) == ["gone"], 10,
                         "the deleted topic's index files to be removed")
        assert sorted(os.listdir(os.path.join(queues_dir, "gone"))) == ["0", "1", "2", "3"]


async def test_a_send_during_a_delete_is_refused_not_stored_in_the_going_topic(tmp_path):
    """While a delete is made durable (in a thread), a send to the topic is refused with
    TOPIC_NOT_EXIST ("being deleted"), also with auto-created topics: it neither lands in
    the topic that goes nor creates it again before it is gone. Sent again after the
    delete, it creates a new topic."""
    async with running_broker(str(tmp_path / "d"), auto_create_topics=True) as b:
        addr = f"127.0.0.1:{b.port}"
        topics = b.store.topics
        gate = threading.Event()
        commit = topics.commit_delete

        def slow_commit(name: str) -> None:
            gate.wait(10)
            commit(name)

        topics.commit_delete = slow_commit
        async with Admin(addr) as admin, Producer(addr, send_timeout=2.0, retries=0) as p:
            await p.send("gone", b"old")
            deleting = asyncio.create_task(admin.delete_topic("gone"))
            await wait_until(lambda: "gone" in topics.deleting, 5, "the delete to start")
            with pytest.raises(OnceqError) as refused:
                await p.send("gone", b"during")
            assert refused.value.code == ErrorCode.TOPIC_NOT_EXIST
            assert "being deleted" in refused.value.message
            gate.set()
            await deleting
            assert not topics.deleting
            r = await p.send("gone", b"after")  # auto-created anew
        async with PullConsumer(addr, "g") as c:
            got = await c.pull("gone", r.queue_id, 0, 10)
        assert [m.body for m in got.messages] == [b"after"] and r.offset == 0
