"""What the consume services and the offset store need of their consumer: a small
interface, so that they depend on none of the consumer's inside (the coordinator
implements it, see ``coordinator.py``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from ..protocol.schema import Message
from .allocation import MessageQueue
from .connection import BrokerConnection
from .process_queue import ProcessQueue


class Requester(Protocol):
    group: str
    client_id: str
    stats: Counter[str]
    clock: Callable[[], float]

    async def call(self, request: Message, timeout: float = 10.0) -> Any:
        """A typed request to the broker; its typed reply."""
        ...

    @property
    def reset_gen(self) -> int | None:
        """The last forced offset reset this member handled (None: none), for the
        requests the broker fences until it has seen it."""
        ...

    def lose(self, pqs: list[ProcessQueue], why: str) -> None:
        """The group moved on without this member on these queues: drop them now, without
        committing, and take them again from the group's offset."""
        ...

    def drop_soon(self, mq: MessageQueue) -> None:
        """Have the next rebalance (soon) drop ``mq`` and take it afresh."""
        ...

    def rebalance_soon(self) -> None: ...

    def lease_lapsed(self, pq: ProcessQueue) -> bool:
        """Whether this member must ask the broker before it hands ``pq``'s messages on."""
        ...

    def confirmed(self, pq: ProcessQueue, sent: float) -> None:
        """The broker confirmed ``pq``'s access lock by a request sent at ``sent``."""
        ...

    async def confirm_lease(self, pq: ProcessQueue) -> None:
        """Wait until the broker confirmed ``pq`` again, or it was dropped."""
        ...

    def is_current(self, conn: BrokerConnection) -> bool:
        """Whether ``conn`` is the connection in use (or none is open)."""
        ...
