"""A client id belongs to the connection whose heartbeat first named it: another
connection naming it is refused (CLIENT_ID_IN_USE) and changes nothing; once the owner's
connection closes, the id is free again (a client that reconnects)."""

from __future__ import annotations

import asyncio

import pytest

from onceq import Admin, ErrorCode, OnceqError
from onceq.client.connection import BrokerConnection
from onceq.protocol.codes import RequestCode
from tests.helpers import running_broker


def hb(client: str) -> dict:
    return {"client": client, "groups": [{"group": "G", "subs": {"T": "*"}}]}


async def test_another_connection_cannot_act_in_a_members_name(tmp_path):
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        owner = await BrokerConnection.open(addr)
        squatter = await BrokerConnection.open(addr)
        try:
            await owner.request(RequestCode.HEARTBEAT, hb("c1"))
            await owner.request(RequestCode.PULL, {"topic": "T", "queue": 0, "offset": 0,
                                                   "group": "G", "client": "c1"})
            assert b.owners.holder("G", "T", 0) == "c1"
            member = b.groups.members("G")[0]
            named = {"group": "G", "client": "c1", "topic": "T", "queue": 0}
            for code, header in [
                    (RequestCode.HEARTBEAT, hb("c1")),
                    (RequestCode.UNREGISTER, {"group": "G", "client": "c1"}),
                    (RequestCode.PULL, {**named, "offset": 0}),
                    (RequestCode.COMMIT_OFFSET, {**named, "offset": 0}),
                    (RequestCode.RELEASE_QUEUE, {**named, "offset": 0}),
                    (RequestCode.UNLOCK_QUEUES, {"group": "G", "client": "c1",
                                                 "queues": [["T", 0, -1]]}),
                    (RequestCode.LOCK_QUEUES, {"group": "G", "client": "c1",
                                               "queues": [["T", 0]]})]:
                with pytest.raises(OnceqError) as exc:
                    await squatter.request(code, header)
                assert exc.value.code == ErrorCode.CLIENT_ID_IN_USE, code
                assert exc.value.retriable
            assert b.groups.members("G") == [member] and member.conn is not None
            assert b.owners.holder("G", "T", 0) == "c1"
            connected = len(b.connections)
            squatter.close()
            while len(b.connections) == connected:  # the broker sees the squatter go
                await asyncio.sleep(0.01)
            assert b.groups.members("G") == [member]
            assert b.owners.holder("G", "T", 0) == "c1"
            # the owner's connection closes: the id is free for the client's next connection
            owner.close()
            again = await BrokerConnection.open(addr)
            try:
                for _ in range(100):
                    try:
                        await again.request(RequestCode.HEARTBEAT, hb("c1"))
                        break
                    except OnceqError as exc:
                        assert exc.code == ErrorCode.CLIENT_ID_IN_USE
                        await asyncio.sleep(0.01)
                assert [m.client_id for m in b.groups.members("G")] == ["c1"]
            finally:
                again.close()
        finally:
            owner.close()
            squatter.close()
