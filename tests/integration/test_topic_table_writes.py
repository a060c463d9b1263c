"""Topic creation and deletion write the topics table (and fsync the commit log) in a
thread: other clients are answered while it runs, and a topic created on first use by a
send at the same moment merges with the client's creation instead of undoing it."""

from __future__ import annotations

import asyncio
import json
import os
import threading

from onceq import Admin, Message, Producer
from onceq.storage.store import MessageStore
from tests.clock import FakeClock
from tests.faultfiles import FaultFiles
from tests.helpers import running_broker, small_store
from tests.unit.test_store import T0, open_store, part


class HeldTableFiles(FaultFiles):
    """Files whose fsync of the topics table's temp file waits while ``hold`` is clear."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = threading.Event()
        self.hold.set()
        self.waiting = threading.Event()  # a table fsync is held now
        self.table_writes = 0
        self.raced = threading.Event()  # a queue directory of topic "t" made while held

    def makedirs(self, path: str) -> None:
        if not self.hold.is_set() and os.path.dirname(path).endswith(f"{os.sep}t"):
            self.raced.set()
        super().makedirs(path)

    def fsync(self, fd: int) -> None:
        if self._path(fd).endswith("topics.json.tmp"):
            self.table_writes += 1
            if not self.hold.is_set():
                self.waiting.set()
                self.hold.wait(30)
        super().fsync(fd)


async def test_other_clients_are_answered_while_the_topics_table_is_written(tmp_path):
    files = HeldTableFiles()
    async with (running_broker(str(tmp_path), files=files) as broker,
                Admin(f"127.0.0.1:{broker.port}") as creator,
                Admin(f"127.0.0.1:{broker.port}") as other):
        await creator.create_topic("before", 2)
        files.hold.clear()
        create = asyncio.create_task(creator.create_topic("held", 4))
        delete = asyncio.create_task(creator.delete_topic("before"))
        assert await asyncio.to_thread(files.waiting.wait, 10)
        # the table's fsync is held: the loop still answers everyone else
        assert await asyncio.wait_for(other.ping(), 5) >= 0
        names = {t["topic"] for t in await asyncio.wait_for(other.list_topics(), 5)}
        assert "held" not in names and "before" in names  # not there before it is durable
        assert not create.done() and not delete.done()
        files.hold.set()
        await asyncio.wait_for(asyncio.gather(create, delete), 10)
        names = {t["topic"] for t in await other.list_topics()}
        assert "held" in names and "before" not in names
    table = json.loads((tmp_path / "topics.json").read_text())
    assert "held" in table and table["held"]["queues"] == 4 and "before" not in table


async def test_a_send_creating_the_topic_during_the_clients_creation_merges(tmp_path):
    files = HeldTableFiles()
    async with (running_broker(str(tmp_path), files=files, auto_create_topics=True,
                               default_queues=2) as broker,
                Admin(f"127.0.0.1:{broker.port}") as admin,
                Producer(f"127.0.0.1:{broker.port}") as producer):
        files.hold.clear()
        create = asyncio.create_task(admin.create_topic("t", 6))
        assert await asyncio.to_thread(files.waiting.wait, 10)
        # the send creates the topic on first use (2 queues) on the loop, and waits there
        # for the table lock the client's write holds: released from a thread once the
        # send's creation has begun
        threading.Thread(target=lambda: (files.raced.wait(10), files.hold.set())).start()
        send = asyncio.create_task(producer.send("t", Message(b"x"), queue=1))
        await asyncio.wait_for(asyncio.gather(create, send), 20)
        assert files.raced.is_set()
        assert await admin.queue_count("t") == 6
        assert await admin.queue_offsets("t", 1) == (0, 1)
    table = json.loads((tmp_path / "topics.json").read_text())
    assert table["t"]["queues"] == 6
    reopened = open_store(tmp_path)
    try:
        assert reopened.get_topic("t").queues == 6
        assert reopened.min_max("t", 1) == (0, 1)
    finally:
        reopened.close()


def test_a_table_written_off_the_loop_is_applied_without_a_second_write(tmp_path):
    files = HeldTableFiles()
    store = MessageStore(small_store(str(tmp_path)), clock=FakeClock(T0), files=files)
    store.open()
    try:
        topics = store.topics
        topics.make_queue_dirs("t", 0, 8)
        topics.commit_create("t", 8, store.log.end)
        assert "t" not in store.topics and files.table_writes == 1  # written, not applied
        # a send's creation on first use (fewer queues) finds the written table: applied as
        # written, with its 8 queues
        t = store.create_topic("t", 3)
        assert t.queues == 8 and store.min_max("t", 7) == (0, 0)
        assert store.create_topic("t", 8) is t  # the client's own apply: nothing to do
        assert files.table_writes == 1
        topics.commit_delete("t")
        assert "t" in store.topics and files.table_writes == 2
        store.delete_topic("t")
        assert "t" not in store.topics and files.table_writes == 2
        assert "t" not in json.loads((tmp_path / "topics.json").read_text())
    finally:
        store.close()


def test_a_topic_grown_by_a_written_table_keeps_its_creation_and_records(tmp_path):
    store = open_store(tmp_path)
    try:
        first = store.create_topic("t", 2)  # created on first use by a send
        store.put("t", 1, [part(1)])
        store.topics.make_queue_dirs("t", 2, 5)
        store.topics.commit_create("t", 5, store.log.end + 1000)  # a later position
        grown = store.create_topic("t", 5)
        assert grown.queues == 5 and grown.created_position == first.created_position
        assert store.min_max("t", 1) == (0, 1)
    finally:
        store.close()
    reopened = open_store(tmp_path)
    try:
        assert reopened.get_topic("t").queues == 5
        assert reopened.min_max("t", 1) == (0, 1)
    finally:
        reopened.close()


async def test_pipelined_creations_and_deletions_apply_in_the_order_sent(tmp_path):
    from onceq.protocol.codes import RequestCode
    from onceq.protocol.frame import REQUEST, encode_frame
    from tests.integration.test_bad_input import Raw

    create, delete = RequestCode.CREATE_TOPIC, RequestCode.DELETE_TOPIC
    ops = [(create, {"topic": "p", "queues": 2}), (delete, {"topic": "p"}),
           (create, {"topic": "p", "queues": 3}), (create, {"topic": "p", "queues": 3}),
           (delete, {"topic": "p"}), (delete, {"topic": "p"}),
           (create, {"topic": "p", "queues": 1, "exclusive": True})]
    async with running_broker(str(tmp_path)) as b:
        raw = await Raw.open(b.port)
        try:
            await raw.write(b"".join(encode_frame(REQUEST, code, i, h)
                                     for i, (code, h) in enumerate(ops, 1)))
            answers = {}
            for _ in ops:
                code, corr, _header, _payload = await raw.read_frame()
                answers[corr] = code
        finally:
            await raw.close()
        codes = [answers[i] for i in range(1, len(ops) + 1)]
        async with Admin(f"127.0.0.1:{b.port}") as admin:
            assert await admin.queue_count("p") == 1, codes
    # only the second deletion in a row finds no topic
    assert [c != 0 for c in codes] == [False, False, False, False, False, True, False]
