"""A producer that records its history, and the check of that history against the log
read back after the run (Jepsen style).

The producer sends ``h-N`` messages one after the other to the group's bootstrap list, all
to queue 0 of one topic; a send that fails is recorded (when, its code, whether it is
retriable) and sent again with the same unique key until it is acknowledged. Each
acknowledgement is recorded with the offset it names and when the send started and
ended. The check reads the whole queue afterwards: every acknowledged key must be there
exactly once, at the offset its acknowledgement named.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from onceq.client.message import Message
from onceq.client.producer import Producer
from onceq.client.pull import PullConsumer
from onceq.protocol.codes import PullStatus
from onceq.protocol.errors import OnceqError
from tests.helpers import wait_until

TOPIC = "history"


@dataclass
class Failure:
    at: float
    code: int
    retriable: bool
    message: str


@dataclass
class History:
    # key -> (offset, sent, acknowledged), monotonic times
    acked: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def start(self, bootstrap: str, send_timeout: float) -> History:
        self.task = asyncio.get_running_loop().create_task(self._produce(bootstrap,
                                                                         send_timeout))
        return self

    async def finish(self) -> None:
        self.stop.set()
        if self.task is not None:
            await self.task

    async def _produce(self, bootstrap: str, send_timeout: float) -> None:
        async with Producer(bootstrap, send_timeout=send_timeout) as p:
            i = 0
            while not self.stop.is_set():
                key = f"h-{i}"
                sent = time.monotonic()
                try:
                    r = await p.send(TOPIC, Message(key.encode(), unique_key=key), queue=0)
                except OnceqError as exc:  # maybe stored: sent again with the same key
                    self.failures.append(Failure(time.monotonic(), int(exc.code),
                                                 exc.retriable, exc.message))
                    await asyncio.sleep(0.05)
                    continue
                self.acked[key] = (r.offset, sent, time.monotonic())
                i += 1

    def acked_after(self, t: float) -> int:
        """How many sends started after ``t`` were acknowledged."""
        return sum(1 for _, sent, _ in self.acked.values() if sent > t)

    async def wait_acked_after(self, t: float, n: int, timeout: float, what: str) -> None:
        async def enough() -> bool:
            if self.task is not None and self.task.done():
                self.task.result()  # the producer failed: say why
            return self.acked_after(t) >= n

        await wait_until(enough, timeout, what, interval=0.05)


async def read_back(address: str) -> dict[str, list[int]]:
    """Every body of the queue with the offsets it is stored at, the whole queue read."""
    out: dict[str, list[int]] = {}
    async with PullConsumer(address, "history-check") as c:
        offset = 0
        while True:
            r = await c.pull(TOPIC, 0, offset, 256)
            if r.status != PullStatus.FOUND:
                return out
            for m in r.messages:
                out.setdefault(m.body.decode(), []).append(m.queue_offset)
            offset = r.next_offset


def check(history: History, stored: dict[str, list[int]]) -> dict[str, list[str]]:
    """What went wrong: acknowledged keys lost, keys stored more than once, acknowledged
    keys stored at another offset than the acknowledgement named."""
    return {
        "lost": sorted(k for k in history.acked if k not in stored),
        "stored_twice": sorted(k for k, offsets in stored.items() if len(offsets) > 1),
        "moved": sorted(k for k, (offset, _, _) in history.acked.items()
                        if k in stored and stored[k] != [offset]),
    }
