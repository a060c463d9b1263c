"""Consumer-group settings of RocketMQ clients: which groups are FIFO, and how many times a
message is delivered before it goes to the group's dead-letter queue (pure but for reading
one file).

RocketMQ 5 clients learn both from the server's ``Settings``: ``subscription.fifo`` (a
FIFO PushConsumer then consumes each message group in order, retrying locally, and
forwards a message it gave up on to the dead-letter queue) and ``backoff_policy``
(``max_attempts``, the delays of a PushConsumer's retries). RocketMQ keeps them on its
subscription groups; onceq keeps them in ``rocketmq_groups.json`` in the data directory::

    {"version": 1,
     "groups": {"payments": {"fifo": true, "max_delivery_attempts": 5,
                             "retry_delays": "1s 5s"}}}

* ``fifo`` (default false): the group receives each queue's messages one at a time in
  order (``consume.py``, ``assign.py``);
* ``max_delivery_attempts`` (default 17: onceq's ``max_reconsume`` of 16 retries, plus the
  first delivery, as RocketMQ's 16 retries): a message delivered this many times and not
  acknowledged goes to ``%DLQ%<group>`` instead of being delivered again;
* ``retry_delays`` (default none: the clients' own, 1 s): the PushConsumers' back-off, in
  onceq's delay-level notation (``1s 30s 5m``), attempt 1 first, the last repeated;
  whole seconds of at least 1 (the clients read only the seconds of each).

A group not named has the defaults. ``onceq rocketmq group set/list/delete`` write and
show the file (``cli/rocketmq_cmd.py``). The broker reads the file at start and again when it
changes (checked at most once a second), so a group is marked FIFO without a restart; its
members already running keep the mode they started with (the clients read it once), so
restart them after the change. A file that does not read leaves the settings read before in
place (and is logged).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..broker.front_end import file_stamp, write_file_atomic
from ..broker.retry import parse_delay_levels

log = logging.getLogger("onceq.rocketmq")

FILE = "rocketmq_groups.json"
VERSION = 1
DEFAULT_MAX_RECONSUME = 16  # onceq's own (PushConsumerConfig.max_reconsume, SendBack)
DEFAULT_MAX_ATTEMPTS = DEFAULT_MAX_RECONSUME + 1
MAX_ATTEMPTS = 10_001  # SendBack's max_reconsume is at most 10,000
CHECK_EVERY_S = 1.0
MAX_INVISIBLE_S = 12 * 3600  # a retry delay is an invisible duration (consume.py)


@dataclass(frozen=True, slots=True)
class GroupSettings:
    fifo: bool = False
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    retry_delays: tuple[float, ...] = ()  # seconds; empty: the clients' own


DEFAULT = GroupSettings()


def parse(raw: bytes) -> dict[str, GroupSettings]:
    """The groups of a settings file; ValueError saying what is wrong."""
    doc = json.loads(raw)
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(f"not a RocketMQ group-settings file of version {VERSION}")
    groups = doc.get("groups", {})
    if not isinstance(groups, dict):
        raise ValueError("'groups' is not an object")
    out = {}
    for name, e in groups.items():
        if not isinstance(e, dict):
            raise ValueError(f"group {name!r}: not an object")
        unknown = set(e) - {"fifo", "max_delivery_attempts", "retry_delays"}
        if unknown:
            raise ValueError(f"group {name!r}: unknown setting(s) {', '.join(sorted(unknown))}")
        fifo = e.get("fifo", False)
        if not isinstance(fifo, bool):
            raise ValueError(f"group {name!r}: fifo must be true or false")
        attempts = e.get("max_delivery_attempts", DEFAULT_MAX_ATTEMPTS)
        if (not isinstance(attempts, int) or isinstance(attempts, bool)
                or not 1 <= attempts <= MAX_ATTEMPTS):
            raise ValueError(f"group {name!r}: max_delivery_attempts must be an integer "
                             f"1..{MAX_ATTEMPTS}")
        delays = e.get("retry_delays", "")
        if not isinstance(delays, str):
            raise ValueError(f"group {name!r}: retry_delays must be a string like '1s 5s'")
        try:
            parsed = tuple(parse_delay_levels(delays)) if delays.strip() else ()
        except ValueError as exc:
            raise ValueError(f"group {name!r}: retry_delays: {exc}") from None
        if any(d < 1 or d != int(d) or d > MAX_INVISIBLE_S for d in parsed):
            raise ValueError(f"group {name!r}: retry_delays must be whole seconds from 1s "
                             "to 12h (the clients read only the seconds of each)")
        out[str(name)] = GroupSettings(fifo, attempts, parsed)
    return out


def dump(groups: dict[str, dict[str, object]]) -> bytes:
    """A settings file's bytes for ``{group: {"fifo": ..., ...}}`` (checked)."""
    raw = json.dumps({"version": VERSION, "groups": groups}, indent=1,
                     sort_keys=True).encode()
    parse(raw)
    return raw


def load(data_dir: str) -> dict[str, dict[str, object]]:
    """The entries of the settings file of ``data_dir`` as written (``{}`` without the
    file), checked; ValueError (or OSError) saying what is wrong."""
    path = os.path.join(data_dir, FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return {}
    try:
        parse(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    return {str(g): dict(e) for g, e in json.loads(raw).get("groups", {}).items()}


def save(data_dir: str, groups: dict[str, dict[str, object]]) -> None:
    """Write the settings file of ``data_dir`` (atomically)."""
    write_file_atomic(os.path.join(data_dir, FILE), dump(groups))


class GroupSettingsFile:
    """The group settings of one data directory, read again when the file changes."""

    def __init__(self, data_dir: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = os.path.join(data_dir, FILE)
        self.clock = clock
        self.groups: dict[str, GroupSettings] = {}
        self.problem = ""  # why the file was not taken the last time it changed
        self._stamp: tuple[int, int, int] | None = None
        self._checked = float("-inf")
        self.refresh()

    def refresh(self) -> None:
        self._checked = self.clock()
        stamp = file_stamp(self.path)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        if stamp is None:
            self.groups, self.problem = {}, ""
            return
        try:
            with open(self.path, "rb") as f:
                self.groups = parse(f.read())
            self.problem = ""
            log.info("RocketMQ group settings read from %s: %s", self.path,
                     ", ".join(f"{g} ({'FIFO, ' if s.fifo else ''}{s.max_attempts} "
                               "attempts)" for g, s in sorted(self.groups.items()))
                     or "none")
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            self.problem = f"{self.path}: {exc}"
            log.error("cannot read the RocketMQ group settings (%s); the settings read "
                      "before stay in place", self.problem)

    def get(self, group: str) -> GroupSettings:
        if self.clock() - self._checked >= CHECK_EVERY_S:
            self.refresh()
        return self.groups.get(group, DEFAULT)
