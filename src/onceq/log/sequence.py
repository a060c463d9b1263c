"""Per-writer sequence numbers: the broker's record of what each idempotent writer has
already stored (pure logic, no I/O).

An idempotent writer (the Spark sink, see ``spark/sink.py``) numbers the messages it sends
to one queue: ``(epoch, seq)``, where the epoch is the writer's unit of replay (a Spark
batch id) and ``seq`` counts the messages of that epoch sent to that queue, from 0. The
broker keeps, per ``(writer, topic, queue)``, the highest ``(epoch, seq)`` it has stored:

- a message numbered at or below it is a duplicate: answered as success, not stored;
- an older epoch is all duplicate (the writer starts an epoch only once every message of
  the previous one is stored);
- the next message must follow without a gap: ``seq == last + 1`` in the same epoch, or
  ``seq == 0`` in a newer epoch. Anything else is refused with ``OUT_OF_ORDER_SEQUENCE``
  (an earlier send of the writer failed: it must send again from there).

The last message of every sequenced batch carries the property ``WRITER_SEQ``
(``"epoch:seq:writer"``) and the part flag ``SEQUENCED``: the record of the sequence is
the message itself, so the commit log can never hold the messages without their sequence
or the other way round. The table is rebuilt at start from a snapshot and the records
after it (``storage/sequences.py``).
"""

from __future__ import annotations

import itertools
import json
from typing import Any, NamedTuple

SEQ_PROPERTY = "WRITER_SEQ"
SEQUENCED = 0x8000  # part flag: this message carries SEQ_PROPERTY (found at replay)
MAX_WRITER_ID = 200
MAX_EPOCH_JUMP = 2 ** 32  # a newer epoch is at most this far past a writer's last one
SNAPSHOT_FORMAT = 1

# (writer, topic, queue)
WriterKey = tuple[str, str, int]


class SequenceError(ValueError):
    """A sequence the broker refuses; ``gap`` tells an out-of-order one from a bad one."""

    def __init__(self, message: str, gap: bool = False) -> None:
        super().__init__(message)
        self.gap = gap


class WriterState(NamedTuple):
    """One writer's place; replaced, never changed, so that a snapshot may take a shallow
    copy of the table on the event loop and encode it elsewhere. A tuple of integers: the
    garbage collector leaves it alone, however many writers there are."""

    epoch: int
    seq: int  # the highest stored sequence number of ``epoch``
    last_ms: int  # store time of the last stored batch (idle expiry)
    position: int  # commit-log position of the record that carries it


def check_writer_id(writer: object) -> str:
    if (not isinstance(writer, str) or not 0 < len(writer) <= MAX_WRITER_ID
            or not writer.isprintable()):
        raise SequenceError(f"writer id must be 1-{MAX_WRITER_ID} printable characters")
    return writer


def marker(writer: str, epoch: int, seq: int) -> str:
    """The ``WRITER_SEQ`` property value of the message numbered ``(epoch, seq)``."""
    return f"{epoch}:{seq}:{writer}"


def parse_marker(value: object) -> tuple[str, int, int]:
    """(writer, epoch, seq) from a ``WRITER_SEQ`` value; raises SequenceError."""
    if not isinstance(value, str):
        raise SequenceError("WRITER_SEQ must be a string")
    parts = value.split(":", 2)
    try:
        epoch, seq = int(parts[0]), int(parts[1])
        writer = parts[2]
    except (IndexError, ValueError):
        raise SequenceError(f"malformed WRITER_SEQ {value[:80]!r}") from None
    if epoch < 0 or seq < 0:
        raise SequenceError("epoch and sequence must be >= 0")
    return check_writer_id(writer), epoch, seq


class SequenceTable:
    """``(writer, topic, queue) -> WriterState``."""

    def __init__(self) -> None:
        self.writers: dict[WriterKey, WriterState] = {}
        self.dirty = False

    def __len__(self) -> int:
        return len(self.writers)

    def check(self, key: WriterKey, epoch: int, seq: int, count: int) -> int:
        """How many of ``count`` messages numbered ``seq, seq+1, ...`` in ``epoch`` are
        duplicates (they come first); raises SequenceError on a gap."""
        if epoch < 0 or seq < 0 or count < 1:
            raise SequenceError("epoch and sequence must be >= 0 and the batch not empty")
        state = self.writers.get(key)
        if state is not None and epoch > state.epoch + MAX_EPOCH_JUMP:
            raise SequenceError(
                f"writer {key[0]!r} on {key[1]}:{key[2]}: epoch {epoch} jumps more than "
                f"{MAX_EPOCH_JUMP} past its epoch {state.epoch}: refused (it would make "
                "the writer's next batches look like duplicates)")
        if state is None or epoch > state.epoch:
            if seq != 0:
                raise SequenceError(
                    f"writer {key[0]!r} on {key[1]}:{key[2]}: epoch {epoch} must start at "
                    f"sequence 0, not {seq} (an earlier send failed: send again from there)",
                    gap=True)
            return 0
        if epoch < state.epoch:
            return count  # an older epoch: complete before the newer one started
        if seq > state.seq + 1:
            raise SequenceError(
                f"writer {key[0]!r} on {key[1]}:{key[2]}: sequence {seq} of epoch {epoch} "
                f"follows {state.seq}: messages {state.seq + 1}..{seq - 1} are missing (an "
                "earlier send failed: send again from there)", gap=True)
        return min(count, state.seq + 1 - seq)

    def record(self, key: WriterKey, epoch: int, seq: int, now_ms: int, position: int
               ) -> None:
        """``(epoch, seq)`` is stored at ``position``; keeps the highest."""
        state = self.writers.get(key)
        if state is None or (epoch, seq) >= (state.epoch, state.seq):
            last_ms = now_ms if state is None else max(state.last_ms, now_ms)
            self.writers[key] = WriterState(epoch, seq, last_ms, position)
        elif now_ms > state.last_ms:
            self.writers[key] = WriterState(state.epoch, state.seq, now_ms, state.position)
        self.dirty = True

    def expire(self, now_ms: int, idle_ms: int) -> int:
        """Forget writers that stored nothing for ``idle_ms``; returns how many."""
        old = [k for k, s in self.writers.items() if now_ms - s.last_ms > idle_ms]
        for k in old:
            del self.writers[k]
        if old:
            self.dirty = True
        return len(old)

    def drop_topic(self, topic: str, created_position: int | None = None) -> None:
        """Forget a topic's writers (all, or those recorded before ``created_position``:
        an older topic of the same name)."""
        gone = [k for k, s in self.writers.items() if k[1] == topic and (
            created_position is None or s.position < created_position)]
        for k in gone:
            del self.writers[k]
        if gone:
            self.dirty = True

    # ------------------------------------------------------------------ snapshot
    def encode_snapshot(self, position: int) -> bytes:
        """``writers.json``: the table after every record below ``position``."""
        return encode_writers(self.writers, position)

    @classmethod
    def decode_snapshot(cls, raw: Any) -> tuple[SequenceTable, int]:
        """(table, position) from the parsed JSON; raises ValueError when malformed."""
        if not isinstance(raw, dict) or raw.get("format") != SNAPSHOT_FORMAT:
            raise ValueError("not a writers snapshot of a known format")
        position, rows = raw.get("position"), raw.get("writers")
        if not isinstance(position, int) or position < 0 or not isinstance(rows, list):
            raise ValueError("malformed writers snapshot")
        table = cls()
        try:
            for w, t, q, epoch, seq, last_ms, pos in rows:
                if not all(isinstance(v, int) for v in (q, epoch, seq, last_ms, pos)):
                    raise ValueError("malformed writers snapshot row")
                table.writers[(check_writer_id(w), str(t), q)] = WriterState(
                    epoch, seq, last_ms, pos)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed writers snapshot: {exc}") from None
        return table, position


SNAPSHOT_SLICE = 2048  # rows encoded per call: another thread gets the GIL between slices


def encode_writers(writers: dict[WriterKey, WriterState], position: int) -> bytes:
    """``writers.json`` of ``writers`` (a copy of a table, see ``WriterState``), built as
    text in slices: a thread doing it lets the event loop run in between, and it makes no
    container per row for the garbage collector to chase."""
    dumps = json.dumps
    rows = iter(writers.items())
    parts = []
    while chunk := [f"[{dumps(w)},{dumps(t)},{q},{s[0]},{s[1]},{s[2]},{s[3]}]"
                    for (w, t, q), s in itertools.islice(rows, SNAPSHOT_SLICE)]:
        parts.append(",".join(chunk))
    return (f'{{"format":{SNAPSHOT_FORMAT},"position":{position},'
            f'"writers":[{",".join(parts)}]}}').encode()
