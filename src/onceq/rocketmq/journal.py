"""What RocketMQ consumption keeps across a broker restart, beside the group's committed
offsets (which the broker keeps itself): a small journal in the data directory.

* **acknowledgements above the committed offset**: a message acknowledged while a lower
  one of its queue is still in flight cannot be covered by the group's offset yet. The
  journal keeps it, so that after a restart (which delivers again from the committed
  offset) it is passed over, never delivered again;
* **the receipt key**: receipt handles are signed with a key drawn once and kept in the
  data directory (mode 0600), so the handles of before a restart still decode;
* **delivery attempts**: the attempt of each delivery of a message delivered again (its
  second delivery on), so that after a restart its count carries on and it still goes to
  the dead-letter queue after the group's maximum of attempts (``groups.py``). A first
  delivery is not journaled (one write per delivered message would be): a message
  delivered only once before a restart counts from 1 again after it;
* **the generation reserve**: each delivery has a generation, unique across restarts (the
  journal reserves them in blocks): a handle of an earlier run is told from the handle of
  a delivery made since the restart.

The journal is JSON lines (``["a", group, topic, queue, offset]``, ``["n", group, topic,
queue, offset, attempt]``, ``["g", reserve]``),
appended with one ``write`` each (a killed process loses nothing written; with ``flush =
"sync"`` each acknowledgement is also fsynced before it is answered). A torn last line is
ignored. At start it is read and written again compacted (temp file, fsync, rename), and
again whenever it has grown past ``COMPACT_AFTER`` records.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from collections.abc import Callable

from ..broker.front_end import write_file_atomic

log = logging.getLogger("onceq.rocketmq")

FILE = "rocketmq_pop.journal"
KEY_FILE = "rocketmq_receipt.key"
RESERVE_BLOCK = 100_000  # generations reserved with one journal record
COMPACT_AFTER = 50_000  # records appended before the journal is written again compacted

Key3 = tuple[str, str, int]  # group, topic, queue


def load_key(data_dir: str) -> bytes:
    """The receipt key of this data directory (drawn and saved on first use)."""
    path = os.path.join(data_dir, KEY_FILE)
    try:
        with open(path, "rb") as f:
            key = f.read()
        if len(key) >= 16:
            return key
        log.error("%s is damaged: drawing a new receipt key (older handles are refused)",
                  path)
    except FileNotFoundError:
        pass
    key = secrets.token_bytes(32)
    write_file_atomic(path, key, private=True)
    return key


class PopJournal:
    """The acknowledgements above the committed offsets and the generation reserve."""

    def __init__(self, data_dir: str, *, sync: bool) -> None:
        self.path = os.path.join(data_dir, FILE)
        self.sync = sync
        self.acked: dict[Key3, set[int]] = {}
        self.attempts: dict[Key3, dict[int, int]] = {}  # deliveries of those sent again
        self.first_generation = 1  # the first generation this run may issue
        self._reserve = 0
        self._records = 0
        self._fd = -1

    # ---------------------------------------------------------------- start
    def open(self, committed: Callable[[str, str, int], int]) -> None:
        """Read the journal, keep the acknowledgements still above their group's committed
        offset (``committed(group, topic, queue)``, -1: none), write it compacted."""
        reserve = 0
        try:
            with open(self.path, "rb") as f:
                lines = f.read().split(b"\n")
        except FileNotFoundError:
            lines = []
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if rec[0] == "a":
                    key = (str(rec[1]), str(rec[2]), int(rec[3]))
                    self.acked.setdefault(key, set()).add(int(rec[4]))
                elif rec[0] == "n":
                    key = (str(rec[1]), str(rec[2]), int(rec[3]))
                    per = self.attempts.setdefault(key, {})
                    per[int(rec[4])] = max(per.get(int(rec[4]), 0), int(rec[5]))
                elif rec[0] == "g":
                    reserve = max(reserve, int(rec[1]))
            except (ValueError, IndexError, TypeError):
                if n < len(lines) - 1:  # not a torn last write: say so
                    log.error("%s: record %d does not read; skipped", self.path, n + 1)
        for key, offs in self.acked.items():  # an acknowledged message has no count
            for off in offs:
                self._settled(key, off)
        for key in list(self.acked) + list(self.attempts):
            self.prune(key, committed(*key))
        self.first_generation = reserve + 1
        self._reserve = reserve
        self._compact()

    def _compact(self) -> None:
        self._reserve = max(self._reserve, self.first_generation)
        rows = [json.dumps(["g", self._reserve])]
        rows += [json.dumps(["a", *key, off]) for key, offs in sorted(self.acked.items())
                 for off in sorted(offs)]
        rows += [json.dumps(["n", *key, off, n]) for key, per in sorted(self.attempts.items())
                 for off, n in sorted(per.items())]
        if self._fd >= 0:
            os.close(self._fd)
        write_file_atomic(self.path, ("\n".join(rows) + "\n").encode())
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._records = len(rows)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # ---------------------------------------------------------------- records
    def _append(self, rec: list[object]) -> None:
        if self._fd < 0:
            return
        os.write(self._fd, (json.dumps(rec) + "\n").encode())
        self._records += 1
        if self._records > COMPACT_AFTER:
            self._compact()

    def reserve(self, generation: int) -> None:
        """``generation`` is about to be issued: reserve a block past it when needed."""
        if generation > self._reserve:
            self._reserve = generation + RESERVE_BLOCK
            self._append(["g", self._reserve])
            if self._fd >= 0:
                os.fsync(self._fd)  # once per block: a reused generation would be unsafe

    def delivered(self, key: Key3, offset: int, attempt: int) -> None:
        """A message was delivered again (``attempt`` >= 2): keep its count. Not fsynced:
        a count lost with the machine only lets the message be delivered once more."""
        if attempt < 2:
            return
        self.attempts.setdefault(key, {})[offset] = attempt
        self._append(["n", *key, offset, attempt])

    def attempts_of(self, key: Key3, offset: int) -> int:
        """Deliveries of the message journaled before (0: none)."""
        per = self.attempts.get(key)
        return 0 if per is None else per.get(offset, 0)

    async def ack(self, key: Key3, offset: int) -> None:
        """Keep an acknowledgement above the committed offset (durably, when answered)."""
        self._settled(key, offset)
        self.acked.setdefault(key, set()).add(offset)
        self._append(["a", *key, offset])
        if self.sync and self._fd >= 0:
            await asyncio.to_thread(os.fsync, self._fd)

    def is_acked(self, key: Key3, offset: int) -> bool:
        s = self.acked.get(key)
        return s is not None and offset in s

    def _settled(self, key: Key3, offset: int) -> None:
        per = self.attempts.get(key)
        if per is not None:
            per.pop(offset, None)
            if not per:
                del self.attempts[key]

    def prune(self, key: Key3, committed: int) -> None:
        """Forget the acknowledgements (and counts) the committed offset covers now."""
        per = self.attempts.get(key)
        if per is not None:
            for off in [o for o in per if o < committed]:
                del per[off]
            if not per:
                del self.attempts[key]
        s = self.acked.get(key)
        if s is None:
            return
        s.difference_update([o for o in s if o < committed])
        if not s:
            del self.acked[key]

    def forget(self, key: Key3) -> None:
        """The group's offset was reset: its acknowledgements no longer apply."""
        had = self.acked.pop(key, None) is not None
        had = self.attempts.pop(key, None) is not None or had
        if had and self._fd >= 0:
            self._compact()
