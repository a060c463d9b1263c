"""Reading one queue range on an executor: pipelined pulls, Arrow record batches out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pyarrow as pa

from ..client.connection import ConnectionLost, retriable
from ..client.pull import PullConsumer
from ..client.security import ClientSecurity
from ..protocol.codes import PullStatus
from ..protocol.errors import OnceqError
from .arrow import records_to_batch
from .options import check_loss
from .retry import Backoff

log = logging.getLogger("onceq.spark")


@dataclass(frozen=True, slots=True)
class QueueRange:
    """Everything ``read()`` needs to read ``[start, end)`` of one queue (picklable)."""

    servers: str
    group: str
    topic: str
    queue: int
    start: int
    end: int
    fail_on_data_loss: bool = True
    pull_batch: int = 1024
    verify_checksums: bool = True
    timeout_s: float = 60.0  # how long the broker may fail every pull (retry.py)
    security: ClientSecurity | None = None  # None: from the environment


async def pull_range(r: QueueRange) -> AsyncIterator[pa.RecordBatch]:
    """Record batches of ``[r.start, r.end)``, one pull always in flight (the broker reads
    the next batch while this one is converted and handed to Spark). A pull that fails with
    a retriable error or a lost connection is sent again on a new connection from the first
    offset not yet handed out, until the broker has failed every attempt for
    ``r.timeout_s``: a broker restart costs a wait, never a message twice or a gap. One
    client serves every attempt: it keeps what it learned of a broker group's leader (a
    ``NOT_LEADER`` answer), a failed attempt drops only its connections."""
    offset = r.start
    backoff = Backoff(r.timeout_s, f"reading {r.topic}/{r.queue} at {r.servers}")
    consumer = PullConsumer(r.servers, r.group, verify_checksums=r.verify_checksums,
                            security=r.security)
    try:
        while offset < r.end:
            try:
                stream = consumer.stream(r.topic, r.queue, offset, r.pull_batch,
                                         suspend=0.0, commit=False, decode=False)
                try:
                    async for res in stream:
                        backoff.ok()
                        if res.status == PullStatus.OFFSET_MOVED:
                            offset = check_loss(r.topic, r.queue, offset, res.min_offset,
                                                r.fail_on_data_loss)
                            log.warning("onceq: %s/%d: skipped to offset %d (messages "
                                        "deleted)", r.topic, r.queue, offset)
                        elif res.status == PullStatus.DAMAGED:
                            check_loss(r.topic, r.queue, offset, res.next_offset,
                                       r.fail_on_data_loss)
                        elif res.status != PullStatus.FOUND:
                            raise RuntimeError(
                                f"onceq: {r.topic}/{r.queue} ends at {res.max_offset} while "
                                f"offsets up to {r.end} were planned (was the topic deleted "
                                "and re-created?)")
                        if res.payload:
                            batch = records_to_batch(res.payload, r.verify_checksums,
                                                     min(r.end, res.next_offset), offset)
                            if batch.num_rows:
                                yield batch
                        offset = res.next_offset
                        if offset >= r.end:
                            break
                finally:
                    await stream.aclose()
            except TimeoutError:
                # no answer to a pull: the connection is dropped and the pull sent again
                await consumer.close()
                await asyncio.sleep(backoff.failed(ConnectionLost(
                    f"no answer to a pull of {r.topic}/{r.queue} at offset {offset}")))
            except OnceqError as exc:
                if not retriable(exc):
                    raise
                await consumer.close()
                await asyncio.sleep(backoff.failed(exc))
    finally:
        await consumer.close()


def read_range(r: QueueRange) -> Iterator[pa.RecordBatch]:
    """``pull_range`` for Spark's synchronous ``read()``: a private event loop, driven one
    batch at a time."""
    loop = asyncio.new_event_loop()
    agen = pull_range(r)
    try:
        while True:
            try:
                batch = loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
            yield batch
    finally:
        loop.run_until_complete(agen.aclose())
        loop.close()
