"""Every delivery recorded as it happens, by every member, in its own file.

A member appends one JSON line when a message reaches its listener (``d``) and one when
the listener call returns (``r``). Lines are written with one ``os.write`` each on a file
opened for appending, so a member that is SIGKILLed keeps everything it recorded up to
the kill. Nothing is counted here: ``counting`` reads the files after the run.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

from ...client.push import ConsumeContext, ConsumeStatus
from ...log.record import MessageExt
from ...protocol.codes import PROP_ORIGIN_TOPIC


class DeliveryLog:
    """Appends JSON lines to ``<dir>/<member>.jsonl``."""

    def __init__(self, directory: str, member: str) -> None:
        self.member = member
        path = Path(directory) / f"{member}.jsonl"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


class RecordingListener:
    """Wraps the member's listener: records each delivery, then calls the listener.

    ``delivery_ids`` maps a message object to the id recorded for it, so the business
    handler can store the id with its effect (``shop.Shop.apply``).
    """

    def __init__(self, inner: Any, log: DeliveryLog) -> None:
        self.inner = inner
        self.log = log
        self.delivery_ids: dict[int, str] = {}
        self._seq = itertools.count(1)
        self._sync = not (inspect.iscoroutinefunction(inner)
                          or inspect.iscoroutinefunction(type(inner).__call__))

    async def on_consumer_start(self, consumer: Any) -> None:
        hook = getattr(self.inner, "on_consumer_start", None)
        if hook is not None:
            await hook(consumer)

    async def __call__(self, msgs: list[MessageExt], ctx: ConsumeContext) -> ConsumeStatus:
        ids = []
        for m in msgs:
            did = f"{self.log.member}:{next(self._seq)}"
            ids.append(did)
            self.delivery_ids[id(m)] = did
            self.log.write({"k": "d", "id": did, "t": time.time(), "m": self.log.member,
                            "uk": m.unique_key, "o": m.keys, "tp": m.topic,
                            "otp": m.properties.get(PROP_ORIGIN_TOPIC, m.topic),
                            "q": m.queue_id, "off": m.queue_offset, "rc": m.reconsume_times})
        status = ConsumeStatus.RECONSUME_LATER
        try:
            if self._sync:
                result = await asyncio.get_running_loop().run_in_executor(
                    None, self.inner, msgs, ctx)
            else:
                result = await self.inner(msgs, ctx)
            status = ConsumeStatus(result or ConsumeStatus.SUCCESS)
            return status
        finally:
            acked = ctx.ack_index + 1 if status is ConsumeStatus.SUCCESS else 0
            self.log.write({"k": "r", "ids": ids, "t": time.time(), "st": status.value,
                            "acked": min(acked, len(ids))})
            for m in msgs:
                self.delivery_ids.pop(id(m), None)
