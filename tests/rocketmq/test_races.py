"""Acknowledgements, changes and forwards of the RocketMQ endpoint racing a receive of the
same group while they wait for the broker (a ``GetOffset``, a ``SEND_BACK`` or a pull
answered a moment later, as ``Bridge.call`` and ``Bridge.submit`` allow).

Each test runs the endpoint in the test's process on a broker of its own, holds one of the
broker's answers until the racing request has run, and checks that the outcome is the one
the rules give: a receipt handle of before a restart is refused once its message was
delivered again; a message acknowledged is not delivered again; a delivery being moved to
the dead-letter queue is not delivered again meanwhile.

``test_an_old_handle_is_refused_when_its_message_is_delivered_during_the_ack`` in
``test_chaos.py`` is the SimpleConsumer's case of the first rule.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("grpc")

from onceq import Admin, Producer
from onceq.broker.broker import Broker
from onceq.protocol.replies import OffsetReply
from onceq.protocol.requests import GetOffset, Pull, SendBack
from onceq.rocketmq._pb import definition_pb2 as pb
from onceq.rocketmq.bridge import FrontConnection
from onceq.rocketmq.consume import Receive
from onceq.rocketmq.mapping import Code, RmqError
from onceq.rocketmq.server import GrpcFrontEnd
from onceq.rocketmq.service import Client, MessagingService
from tests.helpers import free_port, running_broker

TOPIC, GROUP = "rmq-races", "rmq-races-g"
RACING = contextvars.ContextVar("racing", default=False)  # set in the held request's task


@asynccontextmanager
async def broker_with(tmp_path: Path, bodies: list[bytes]) -> AsyncIterator[Broker]:
    """A broker with ``TOPIC`` (one queue) holding ``bodies``."""
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as a:
            await a.create_topic(TOPIC, 1)
        async with Producer(addr) as p:
            for body in bodies:
                await p.send(TOPIC, body, queue=0)
        yield b


@asynccontextmanager
async def endpoint(b: Broker) -> AsyncIterator[MessagingService]:
    """The RocketMQ endpoint of ``b`` (stopping it is a restart of the endpoint: the
    deliveries in flight are not kept, the receipt key and the journal are)."""
    fe = GrpcFrontEnd(free_port())
    await fe.start(b)
    try:
        assert fe.service is not None
        yield fe.service
    finally:
        await fe.stop()


def hold_calls(svc: MessagingService, kind: type, gate: asyncio.Event) -> None:
    """``Bridge.call`` of a ``kind`` request made in a ``RACING`` task is answered once
    ``gate`` is set."""
    bridge = svc.bridge
    call = bridge.call

    async def held(conn: Any, req: Any) -> Any:
        if RACING.get() and isinstance(req, kind):
            await gate.wait()
        return await call(conn, req)

    bridge.call = held  # type: ignore[method-assign]


def hold_pulls(svc: MessagingService, gate: asyncio.Event) -> list[asyncio.Task[None]]:
    """A pull submitted in a ``RACING`` task is answered to its future once ``gate`` is
    set (as a pull the broker answers later)."""
    bridge = svc.bridge
    submit = bridge.submit
    tasks: list[asyncio.Task[None]] = []

    def held(conn: Any, req: Any) -> Any:
        reply, corr, fut = submit(conn, req)
        if not (RACING.get() and isinstance(req, Pull) and reply is not None):
            return reply, corr, fut
        later: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        async def answer() -> None:
            await gate.wait()
            later.set_result(reply)

        tasks.append(asyncio.create_task(answer()))
        return None, corr, later

    bridge.submit = held  # type: ignore[method-assign]
    return tasks


def racing(coro_fn: Callable[[], Any]) -> asyncio.Task[Any]:
    async def run() -> Any:
        RACING.set(True)
        return await coro_fn()
    return asyncio.create_task(run())


async def push_member(svc: MessagingService, cid: str = "c1") -> str:
    """A PushConsumer ``cid`` of ``GROUP`` subscribed to ``TOPIC`` (it holds queue 0)."""
    c = Client(cid, FrontConnection("test"), client_type=pb.PUSH_CONSUMER)
    svc.clients[cid] = c
    await svc._member(c, GROUP, TOPIC)
    return cid


async def committed(svc: MessagingService) -> int:
    reply = await svc.bridge.call(svc.conn, GetOffset(GROUP, TOPIC, 0))
    assert isinstance(reply, OffsetReply)
    return reply.offset


def handle(m: pb.Message) -> str:
    return m.system_properties.receipt_handle


# ---------------------------------------------------------------- old handles
async def test_a_push_consumers_old_handle_is_refused_when_its_message_is_delivered_during_the_ack(
        tmp_path: Path) -> None:
    """The PushConsumer's case of ``ack_earlier``: its acknowledgement of a handle of
    before a restart waits for ``GetOffset`` while its receive delivers the message again;
    the old handle is refused (and not journaled: the new delivery's ack settles it)."""
    async with broker_with(tmp_path, [b"m"]) as b:
        async with endpoint(b) as first:
            cid = await push_member(first)
            got = await first.queues.receive(Receive(GROUP, TOPIC, None, 1, 60, 0), cid, 0)
            old = handle(got[0])
        async with endpoint(b) as svc:
            await push_member(svc, cid)
            gate = asyncio.Event()
            hold_calls(svc, GetOffset, gate)
            acking = racing(lambda: svc.queues.ack(cid, GROUP, TOPIC, old))
            await asyncio.sleep(0.05)  # the ack waits for its GetOffset
            again = await svc.queues.receive(Receive(GROUP, TOPIC, None, 1, 60, 0), cid, 0)
            assert [m.body for m in again] == [b"m"]
            gate.set()
            with pytest.raises(RmqError) as e:
                await acking
            assert e.value.code == Code.INVALID_RECEIPT_HANDLE
            assert not svc.pop.is_acked((GROUP, TOPIC, 0), 0)
            await svc.queues.ack(cid, GROUP, TOPIC, handle(again[0]))  # the newest counts
            assert await committed(svc) == 1


async def test_an_old_handle_forwarded_while_its_message_is_delivered_again_is_refused(
        tmp_path: Path) -> None:
    """``ForwardMessageToDeadLetterQueue`` with a handle of before a restart stores the
    dead letter; a receive delivers the message again meanwhile: the forward is refused
    (the newer delivery counts), not answered OK while the message is consumed again."""
    async with broker_with(tmp_path, [b"m"]) as b:
        async with endpoint(b) as first:
            got = await first.pop.receive(Receive(GROUP, TOPIC, None, 1, 60, 0))
            old = handle(got[0])
        async with endpoint(b) as svc:
            gate = asyncio.Event()
            hold_calls(svc, SendBack, gate)
            forwarding = racing(lambda: svc.pop.forward_pop(GROUP, TOPIC, old, 3, 3))
            await asyncio.sleep(0.05)  # the dead letter waits to be stored
            again = await svc.pop.receive(Receive(GROUP, TOPIC, None, 1, 60, 0))
            assert [m.body for m in again] == [b"m"]
            gate.set()
            with pytest.raises(RmqError) as e:
                await forwarding
            assert e.value.code == Code.INVALID_RECEIPT_HANDLE
            assert not svc.pop.is_acked((GROUP, TOPIC, 0), 0)
            await svc.pop.ack(GROUP, TOPIC, handle(again[0]))
            assert await committed(svc) == 1


# ---------------------------------------------------------------- dead letters
async def test_a_delivery_being_forwarded_is_not_delivered_again_meanwhile(
        tmp_path: Path) -> None:
    """A forward stores the dead letter while the delivery's invisible duration runs out:
    a receive then must not deliver it again (it would be consumed and dead-lettered, its
    new handle void); once stored it counts as acknowledged."""
    async with broker_with(tmp_path, [b"m"]) as b, endpoint(b) as svc:
        got = await svc.pop.receive(Receive(GROUP, TOPIC, None, 1, 0.2, 0))
        gate = asyncio.Event()
        hold_calls(svc, SendBack, gate)
        forwarding = racing(lambda: svc.pop.forward_pop(GROUP, TOPIC, handle(got[0]), 3, 3))
        await asyncio.sleep(0.3)  # visible again while its dead letter is being stored
        again = await svc.pop.receive(Receive(GROUP, TOPIC, None, 1, 60, 0))
        assert again == []
        with pytest.raises(RmqError) as e:  # its handle settles nothing meanwhile
            await svc.pop.ack(GROUP, TOPIC, handle(got[0]))
        assert e.value.code == Code.INVALID_RECEIPT_HANDLE
        gate.set()
        await forwarding
        assert svc.pop.dead_letters == 1
        assert svc.pop.table.inflight_count(GROUP, TOPIC) == 0
        assert await committed(svc) == 1
        assert await svc.pop.receive(Receive(GROUP, TOPIC, None, 1, 60, 0)) == []


async def test_a_failed_dead_letter_leaves_the_delivery_as_it_was(tmp_path: Path) -> None:
    """A forward whose dead letter cannot be stored fails; the delivery stays the
    consumer's (its handle still acknowledges it)."""
    from onceq.protocol.errors import ErrorCode, OnceqError

    async with broker_with(tmp_path, [b"m"]) as b, endpoint(b) as svc:
        got = await svc.pop.receive(Receive(GROUP, TOPIC, None, 1, 60, 0))
        call = svc.bridge.call

        async def full(conn: Any, req: Any) -> Any:
            if isinstance(req, SendBack):
                raise OnceqError(ErrorCode.DISK_FULL, "no room")
            return await call(conn, req)

        svc.bridge.call = full  # type: ignore[method-assign]
        with pytest.raises(OnceqError):
            await svc.pop.forward_pop(GROUP, TOPIC, handle(got[0]), 3, 3)
        svc.bridge.call = call  # type: ignore[method-assign]
        await svc.pop.ack(GROUP, TOPIC, handle(got[0]))
        assert svc.pop.dead_letters == 0 and await committed(svc) == 1


# ---------------------------------------------------------------- a redelivery and an ack
async def test_a_push_redelivery_is_dropped_when_acknowledged_while_its_pull_waits(
        tmp_path: Path) -> None:
    """A PushConsumer's delivery becomes visible again; its receive pulls the message to
    deliver it again, and the acknowledgement of the delivery (its handle is still the
    current one) is answered while that pull waits: the message, acknowledged, must not
    be delivered again."""
    async with broker_with(tmp_path, [b"m"]) as b, endpoint(b) as svc:
        cid = await push_member(svc)
        got = await svc.queues.receive(Receive(GROUP, TOPIC, None, 1, 0.2, 0), cid, 0)
        assert [m.body for m in got] == [b"m"]
        await asyncio.sleep(0.3)  # visible again
        gate = asyncio.Event()
        hold_pulls(svc, gate)
        receiving = racing(lambda: svc.queues.receive(
            Receive(GROUP, TOPIC, None, 1, 60, 0), cid, 0))
        await asyncio.sleep(0.05)  # the redelivery's pull waits
        await svc.queues.ack(cid, GROUP, TOPIC, handle(got[0]))  # answered OK
        gate.set()
        assert await receiving == []
        assert await committed(svc) == 1
