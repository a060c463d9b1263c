"""Creating a topic of many queues makes its index directories in a thread, and deleting
one removes its files in a thread: other requests are answered meanwhile, and the topic is
whole when its answer comes."""

from __future__ import annotations

import os

from onceq import Admin, Producer, PullConsumer
from onceq.protocol.codes import RequestCode
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
