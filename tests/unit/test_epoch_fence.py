"""A client of a broker group refuses an answer of a leader older than one it has seen
(``BrokerConnection.fence``): the answer fails ``NOT_LEADER``, retriable, and the client
goes to look for the leader; answers of the newest leader, and of standalone brokers
(untagged), pass."""

from __future__ import annotations

import asyncio

import pytest

from onceq.client.connection import BrokerConnection
from onceq.client.route import BrokerRoute
from onceq.protocol.errors import ErrorCode, OnceqError
from onceq.protocol.frame import RESPONSE, encode_frame
from onceq.protocol.replies import SendReply


class _Transport:
    def write(self, data: bytes) -> None:
        pass

    def writelines(self, data: list[bytes]) -> None:
        pass

    def close(self) -> None:
        pass


async def _answer(conn: BrokerConnection, header: dict) -> object:
    fut = conn.send_request(10, {}, b"", SendReply)
    corr = max(conn._pending)
    conn.data_received(encode_frame(RESPONSE, 0, corr, header))
    return await fut


async def test_an_answer_of_an_older_leader_is_refused() -> None:
    route = BrokerRoute("127.0.0.1:1,127.0.0.1:2")
    conn = BrokerConnection(None)
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    conn.fence = route
    reply = await _answer(conn, {"queue": 0, "base": 5, "n": 1, "ep": 3})
    assert isinstance(reply, SendReply) and reply.offsets == [5]
    assert route.epoch == 3  # the fence moved up
    with pytest.raises(OnceqError) as err:
        await _answer(conn, {"queue": 0, "base": 6, "n": 1, "ep": 2})
    assert err.value.code == ErrorCode.NOT_LEADER and err.value.retriable
    assert "older than epoch 3" in err.value.message
    # the same epoch, a newer one, or an untagged answer (a standalone broker) pass
    for header in ({"ep": 3}, {"ep": 4}, {}):
        reply = await _answer(conn, {"queue": 0, "base": 7, "n": 1, **header})
        assert isinstance(reply, SendReply)
    assert route.epoch == 4
    await asyncio.sleep(0)


def test_a_redirect_raises_the_fence_to_the_leader_it_names() -> None:
    route = BrokerRoute("127.0.0.1:1,127.0.0.1:2")
    exc = OnceqError(ErrorCode.NOT_LEADER, "not the leader",
                     {"leader": "127.0.0.1:2", "epoch": 7})
    assert route.redirect(exc) and route.current == "127.0.0.1:2" and route.epoch == 7


async def test_epochs_are_counted_per_broker_group() -> None:
    """A bootstrap list naming brokers of two groups: a leader found in another group
    starts the fence again (its epochs are its own), one of the same group does not."""
    route = BrokerRoute("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3")
    status = {"127.0.0.1:1": {"role": "leader", "group": "g1"},
              "127.0.0.1:2": {"role": "follower", "group": "g1", "leader": "127.0.0.1:1"},
              "127.0.0.1:3": {"role": "leader", "group": "g2"}}

    async def ask(address: str) -> dict | None:
        return status.get(address)

    route.current = "127.0.0.1:3"
    assert await route.find_leader(ask) == "127.0.0.1:1"
    route.epoch = 9  # g1's leader answered with epoch 9
    del status["127.0.0.1:1"]  # out of reach: its follower still names it
    assert await route.find_leader(ask) == "127.0.0.1:1" and route.epoch == 9
    del status["127.0.0.1:2"]
    assert await route.find_leader(ask) == "127.0.0.1:3"
    assert route.epoch == 0 and route.group_name == "g2"  # g2's epoch 1 is not refused
