"""Reading one queue range on an executor: pipelined pulls, Arrow record batches out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pyarrow as pa

from ..client.pull import PullConsumer
from ..protocol.codes import PullStatus
from .arrow import records_to_batch
from .options import check_loss

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


async def pull_range(r: QueueRange) -> AsyncIterator[pa.RecordBatch]:
    """Record batches of ``[r.start, r.end)``, one pull always in flight (the broker reads
    the next batch while this one is converted and handed to Spark)."""
    if r.end <= r.start:
        return
    consumer = PullConsumer(r.servers, r.group, verify_checksums=r.verify_checksums)
    try:
        offset = r.start
        stream = consumer.stream(r.topic, r.queue, r.start, r.pull_batch, suspend=0.0,
                                 commit=False, decode=False)
        try:
            async for res in stream:
                if res.status == PullStatus.OFFSET_MOVED:
                    offset = check_loss(r.topic, r.queue, offset, res.min_offset,
                                        r.fail_on_data_loss)
                    log.warning("onceq: %s/%d: skipped to offset %d (messages deleted)",
                                r.topic, r.queue, offset)
                elif res.status == PullStatus.DAMAGED:
                    check_loss(r.topic, r.queue, offset, res.next_offset, r.fail_on_data_loss)
                elif res.status != PullStatus.FOUND:
                    raise RuntimeError(
                        f"onceq: {r.topic}/{r.queue} ends at {res.max_offset} while offsets "
                        f"up to {r.end} were planned (was the topic deleted and re-created?)")
                if res.payload:
                    batch = records_to_batch(res.payload, r.verify_checksums, r.end)
                    if batch.num_rows:
                        yield batch
                offset = res.next_offset
                if offset >= r.end:
                    break
        finally:
            await stream.aclose()
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
