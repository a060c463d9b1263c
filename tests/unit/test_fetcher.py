"""The fetcher without a broker: an answer is applied only under the generation its pull
was sent in."""

from __future__ import annotations

import asyncio
from collections import Counter

from onceq.client.allocation import MessageQueue
from onceq.client.assignment import Assignment
from onceq.client.consume_service import ConsumeService
from onceq.client.fetcher import Fetcher
from onceq.client.offset_store import BrokerOffsets
from onceq.client.process_queue import ProcessQueue
from onceq.client.push_config import PushConsumerConfig
from onceq.protocol.codes import PullStatus
from onceq.protocol.replies import PullReply
from onceq.protocol.requests import Pull

MQ = MessageQueue("T", 0)


class Broker:
    """A requester whose pulls wait until the test answers them."""

    group, client_id, reset_gen = "g", "c", None

    def __init__(self) -> None:
        self.stats: Counter[str] = Counter()
        self.pulls: list[tuple[Pull, asyncio.Future[PullReply]]] = []
        self.clock = asyncio.get_running_loop().time

    async def call(self, request, timeout: float = 10.0):
        assert isinstance(request, Pull)
        fut = asyncio.get_running_loop().create_future()
        self.pulls.append((request, fut))
        return await fut

    def lease_lapsed(self, pq) -> bool:
        return False

    def confirmed(self, pq, sent) -> None:
        pass

    def lose(self, pqs, why) -> None:
        raise AssertionError("nothing is lost here")


class Service(ConsumeService):
    def dispatch(self, pq, msgs) -> None:
        raise AssertionError("nothing is pulled here")


async def test_an_answer_to_a_pull_of_an_older_generation_is_not_applied():
    """A forced reset drops the queue and takes it again (a new generation) while a pull
    of the old one, carrying its commit of 50, is out. The late answer must not make the
    offset store believe the broker has 50: the new generation's commits from 0 would
    never be sent."""
    broker = Broker()
    assignment = Assignment()
    offsets = BrokerOffsets(broker, assignment)  # type: ignore[arg-type]
    fetcher = Fetcher(broker, PushConsumerConfig(), assignment, offsets,  # type: ignore[arg-type]
                      Service(broker, PushConsumerConfig(), assignment, offsets, None),  # type: ignore[arg-type]
                      {})
    old = ProcessQueue(MQ, 50, broker.clock())
    assignment.take(old)
    offsets.started(MQ, 40, stored=True)
    fetcher.start(old)
    while not broker.pulls:
        await asyncio.sleep(0)
    request, answer = broker.pulls[0]
    assert request.commit == 50  # the old generation's position rides on its pull

    assignment.drop(old)  # the reset: dropped, released, taken again from offset 0
    assignment.forget(old)
    new = ProcessQueue(MQ, 0, broker.clock())
    assignment.take(new)
    offsets.forget(MQ)
    offsets.started(MQ, 0, stored=True)
    assert not assignment.current(old, old.generation)

    answer.set_result(PullReply(PullStatus.NO_NEW_MESSAGE, 50, 0, 50))
    for _ in range(10):
        await asyncio.sleep(0)
    assert offsets.piggyback(MQ, 10) == 10  # the new generation's commit is still due
    assert old.next_offset == 50 and new.next_offset == 0
    await fetcher.stop(MQ)
