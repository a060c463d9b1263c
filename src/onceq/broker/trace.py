"""Delivery trace: what the broker handed to which consumer, for the duplicate audit.

A group with tracing on (``onceq group trace GROUP on``; kept in ``trace_groups.json`` in
the data directory, so it survives a restart) gets one trace message per pull that
delivered messages and one per membership change, stored in the topic ``%TRACE%``. Each is
an ordinary message, so the ``onceq`` Spark source reads it (``onceq audit``):

* delivery: ``born_timestamp`` is when the broker answered the pull; the body is a JSON
  array with one object per delivered message, ``{"o": offset, "k": unique key,
  "r": reconsume count}``; the properties are ``kind=deliver``, ``group``, ``client``,
  ``topic``, ``queue`` and
  ``handover`` (``1`` when this pull made the client the queue's access-lock holder: the
  first pull after a lock handover, whether the lock was released by the previous holder,
  taken over from one that expired, or never held; always ``0`` without the lock);
* broker start (while some group has tracing on): ``kind=broker``, ``event=start``;
* membership: ``kind=member``, ``group``, ``client`` and ``event``: ``join``, ``leave``
  (a graceful unregister), ``disconnect`` (the connection closed without one: a crash or
  a cut link) or ``expired`` (no heartbeat within the expiry time).

Every record also carries ``src=broker`` and ``seq`` (the record's place in this broker
run). Only the broker writes ``%TRACE%``: client sends to system topics, their deletion
and schedule deliveries into them are refused (``fields.client_written_topic``,
``retry.py``), so a record of the topic carrying ``src=broker`` is the broker's. The audit
reads only those: a record without the mark does not come from the broker's trace and is
no evidence of a delivery.

Cost: with tracing off a pull pays one set lookup. With tracing on, the delivered records'
fixed headers are read (no decoding of bodies or properties) and one trace message is
stored (more when its body would pass half the broker's max body size) before the pull
is answered: a delivery a consumer received is always traced, even
if the broker is killed right after. A trace message the store refuses (full disk) is
dropped and counted (``dropped``), never failing the pull.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable

from ..log.batch import BATCH_RECORD_MAGIC
from ..log.record import (
    PART_FIXED_SIZE,
    REC_HEAD_AND_PART,
    REC_HEADER_SIZE,
    decode_records,
    encode_part,
)
from ..protocol.codes import PROP_TRACE_SOURCE, TRACE_SOURCE_BROKER, TRACE_TOPIC
from ..protocol.errors import OnceqError
from ..storage.store import MessageStore
from .store_errors import StorageError

log = logging.getLogger("onceq.broker")

TRACE_FILE = "trace_groups.json"
TRACE_QUEUES = 4
_HEAD = REC_HEADER_SIZE + PART_FIXED_SIZE
_U32 = struct.Struct("<I")


def delivered_records(payload: bytes | memoryview, first: int = 0, end: int | None = None,
                      tag_hashes: frozenset[int] | None = None) -> list[tuple[int, str, int]]:
    """(queue offset, unique key, reconsume count) of each message a pull payload delivers,
    read from the fixed headers of single records (a batch record's messages are those in
    [``first``, ``end``) with a tag hash in ``tag_hashes``, as ``decode_records`` keeps)."""
    mv = memoryview(payload)
    out = []
    pos, n = 0, len(mv)
    unpack = REC_HEAD_AND_PART.unpack_from
    while pos + REC_HEADER_SIZE <= n:
        total = _U32.unpack_from(mv, pos)[0]
        if total <= REC_HEADER_SIZE:
            break
        if mv[pos + 8] == BATCH_RECORD_MAGIC:
            out += [(m.queue_offset, m.unique_key, m.reconsume_times) for m in
                    decode_records(mv[pos:pos + total], False, first, end, tag_hashes)]
        elif pos + _HEAD <= n:
            (_t, _crc, _m, _r, _q, qoff, _p, _sts, _tl,
             _born, _fl, recons, ulen, *_rest) = unpack(mv, pos)
            out.append((qoff, str(mv[pos + _HEAD:pos + _HEAD + ulen], "ascii"), recons))
        pos += total
    return out


class DeliveryTrace:
    """The traced groups; stores their trace messages."""

    def __init__(self, store: MessageStore, clock: Callable[[], float],
                 on_put: Callable[[str, int], None]) -> None:
        self.store = store
        self.clock = clock
        self.on_put = on_put
        self.groups: set[str] = set()
        self.path = os.path.join(store.config.data_dir, TRACE_FILE)
        self._next_queue = 0
        self._seq = 0  # orders the records of one broker run stored within one millisecond
        self._closed = False
        self.dropped = 0

    # -- settings ------------------------------------------------------------------------
    def load(self) -> None:
        try:
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.error("cannot read %s (%s): tracing is off for every group", self.path, exc)
            return
        if isinstance(data, dict) and isinstance(data.get("groups"), list):
            self.groups = {g for g in data["groups"] if isinstance(g, str)}
        if self.groups:  # the audit's mark for offsets committed before a crash and lost
            self._put([encode_part(b"", "", int(self.clock() * 1000), properties={
                "kind": "broker", "event": "start", **self._stamp()})])

    def set(self, group: str, enabled: bool) -> None:
        """Turn tracing on or off for ``group`` and persist the set (write and rename)."""
        groups = self.groups | {group} if enabled else self.groups - {group}
        if groups == self.groups:
            return
        if enabled and TRACE_TOPIC not in self.store.topics:
            self.store.create_topic(TRACE_TOPIC, TRACE_QUEUES)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"groups": sorted(groups)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.groups = groups
        log.info("delivery trace of group %s turned %s", group, "on" if enabled else "off")

    # -- records -------------------------------------------------------------------------
    def delivered(self, group: str, client: str, handover: bool, topic: str, queue: int,
                  payload: bytes | memoryview, first: int = 0, end: int | None = None,
                  tag_hashes: frozenset[int] | None = None) -> None:
        now = int(self.clock() * 1000)
        props = {"kind": "deliver", "group": group, "client": client, "topic": topic,
                 "queue": str(queue), "handover": "1" if handover else "0",
                 **self._stamp()}
        limit = max(self.store.config.max_body // 2, 1024)  # a body never exceeds max_body
        bodies: list[list[str]] = [[]]
        size = 0
        for o, k, r in delivered_records(payload, first, end, tag_hashes):
            item = f'{{"o":{o},"k":{json.dumps(k)},"r":{r}}}'
            if bodies[-1] and size + len(item) > limit:
                bodies.append([])
                size = 0
            bodies[-1].append(item)
            size += len(item) + 1
        self._put([encode_part(f"[{','.join(b)}]".encode(), "", now, properties=props)
                   for b in bodies])

    def member(self, group: str, client: str, event: str) -> None:
        if group in self.groups:
            self._put([encode_part(b"", "", int(self.clock() * 1000), properties={
                "kind": "member", "group": group, "client": client, "event": event,
                **self._stamp()})])

    def close(self) -> None:
        self._closed = True

    def _stamp(self) -> dict[str, str]:
        """The properties of every record: the broker's mark and the next ``seq``."""
        self._seq += 1
        return {PROP_TRACE_SOURCE: TRACE_SOURCE_BROKER, "seq": str(self._seq)}

    def _put(self, buf: list[bytes]) -> None:
        if not buf or self._closed:
            return
        queue = self._next_queue
        self._next_queue = (queue + 1) % TRACE_QUEUES
        try:
            if TRACE_TOPIC not in self.store.topics:
                self.store.create_topic(TRACE_TOPIC, TRACE_QUEUES)
            queue %= self.store.get_topic(TRACE_TOPIC).queues
            self.store.put(TRACE_TOPIC, queue, buf, dedup=False)
        except (OnceqError, StorageError, OSError) as exc:
            self.dropped += len(buf)
            self.store.errors.error("trace", "delivery trace: %d record(s) dropped: %s",
                                    len(buf), exc)
            return
        self.on_put(TRACE_TOPIC, queue)
