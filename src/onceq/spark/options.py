"""The source's options and offsets, as plain data (no pyspark, no sockets).

Offsets name queues as ``"topic/queue"``; a start or end position is ``"earliest"``,
``"latest"`` or a JSON object per queue in the style of Spark's Kafka source
(``{"orders": {"0": 23, "1": -2}}``, -2 for earliest, -1 for latest).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

EARLIEST = -2
LATEST = -1

# A position per queue: EARLIEST, LATEST or an offset.
Positions = Mapping[int, int]


class OptionError(ValueError):
    """An option the source cannot use; the message names the option."""


class DataLossError(RuntimeError):
    """Offsets the query still had to read were deleted (retention) or lost (damage)."""


@dataclass(frozen=True, slots=True)
class SourceOptions:
    servers: str
    topic: str
    queues: tuple[int, ...] | None  # None: all queues of the topic
    starting: str | Positions  # "earliest", "latest" or positions per queue
    ending: str | Positions
    starting_timestamp: int | None  # epoch ms; wins over ``starting``
    max_messages_per_trigger: int | None
    max_messages_per_partition: int | None
    fail_on_data_loss: bool
    group: str
    pull_batch: int
    verify_checksums: bool

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool) -> SourceOptions:
        """Options as Spark passes them (strings, keys in any case)."""
        opts = {k.lower(): v for k, v in options.items()}
        topic = opts.get("topic", "").strip()
        if not topic:
            raise OptionError("option 'topic' is required")
        queues = None
        if opts.get("queues", "").strip():
            try:
                queues = tuple(sorted({int(q) for q in opts["queues"].split(",") if q.strip()}))
            except ValueError:
                raise OptionError("option 'queues' must be queue numbers separated by commas,"
                                  f" not {opts['queues']!r}") from None
            if not queues or min(queues) < 0:
                raise OptionError(f"option 'queues' has no valid queue: {opts['queues']!r}")
        starting = _positions(opts.get("startingoffsets", "latest" if streaming else "earliest"),
                              topic, "startingOffsets")
        ending = _positions(opts.get("endingoffsets", "latest"), topic, "endingOffsets")
        if streaming and "endingoffsets" in opts:
            raise OptionError("option 'endingOffsets' is for batch reads only")
        ts = _int_option(opts, "startingtimestamp", None, "startingTimestamp", minimum=0)
        max_trigger = _int_option(opts, "maxmessagespertrigger", None, "maxMessagesPerTrigger",
                                  minimum=1)
        if max_trigger is None:  # the name users know from the Kafka source
            max_trigger = _int_option(opts, "maxoffsetspertrigger", None,
                                      "maxOffsetsPerTrigger", minimum=1)
        return cls(
            servers=opts.get("servers", "127.0.0.1:9876"),
            topic=topic,
            queues=queues,
            starting=starting,
            ending=ending,
            starting_timestamp=ts,
            max_messages_per_trigger=max_trigger,
            max_messages_per_partition=_int_option(opts, "maxmessagesperpartition", None,
                                                   "maxMessagesPerPartition", minimum=1),
            fail_on_data_loss=_bool_option(opts, "failondataloss", True, "failOnDataLoss"),
            group=opts.get("group") or default_group(topic, opts),
            pull_batch=_int_option(opts, "pullbatchsize", 1024, "pullBatchSize", minimum=1),
            verify_checksums=_bool_option(opts, "verifychecksums", True, "verifyChecksums"),
        )


def default_group(topic: str, opts: Mapping[str, str]) -> str:
    """A stable group name for a query that sets none: the topic and a hash of the options
    that define what it reads (a restarted query reports under the same name)."""
    ident = json.dumps({k: opts.get(k) for k in ("servers", "topic", "queues", "startingoffsets",
                                                 "startingtimestamp")}, sort_keys=True)
    digest = hashlib.sha1(ident.encode()).hexdigest()[:10]
    return f"spark-{topic}-{digest}"[:127]


def _int_option(opts: Mapping[str, str], key: str, default: int | None, name: str, *,
                minimum: int) -> int | None:
    raw = opts.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise OptionError(f"option {name!r} must be an integer, not {raw!r}") from None
    if value < minimum:
        raise OptionError(f"option {name!r} must be >= {minimum}, not {value}")
    return value


def _bool_option(opts: Mapping[str, str], key: str, default: bool, name: str) -> bool:
    raw = opts.get(key)
    if raw is None:
        return default
    if raw.strip().lower() in ("true", "1", "yes"):
        return True
    if raw.strip().lower() in ("false", "0", "no"):
        return False
    raise OptionError(f"option {name!r} must be true or false, not {raw!r}")


def _positions(raw: str, topic: str, name: str) -> str | dict[int, int]:
    text = raw.strip()
    if text.lower() in ("earliest", "latest"):
        return text.lower()
    try:
        parsed = json.loads(text)
    except ValueError:
        raise OptionError(f"option {name!r} must be 'earliest', 'latest' or JSON like "
                          f'{{"{topic}": {{"0": 42}}}}, not {raw!r}') from None
    if not isinstance(parsed, dict) or set(parsed) != {topic} or not isinstance(
            parsed[topic], dict):
        raise OptionError(f"option {name!r} must map the topic {topic!r} to positions per "
                          f"queue, not {raw!r}")
    try:
        out = {int(q): int(off) for q, off in parsed[topic].items()}
    except (TypeError, ValueError):
        raise OptionError(f"option {name!r}: queues and offsets must be integers") from None
    if any(q < 0 or off < EARLIEST for q, off in out.items()):
        raise OptionError(f"option {name!r}: offsets are >= 0, -2 (earliest) or -1 (latest)")
    return out


def resolve(spec: str | Positions, queue: int, bounds: tuple[int, int]) -> int:
    """The offset a position names on a queue with ``bounds`` (min, max); a queue the JSON
    does not name starts at the earliest offset (as a queue added later does)."""
    lo, hi = bounds
    if spec == "earliest":
        return lo
    if spec == "latest":
        return hi
    assert isinstance(spec, Mapping)
    pos = spec.get(queue, EARLIEST)
    if pos == EARLIEST:
        return lo
    if pos == LATEST:
        return hi
    return pos


def check_loss(topic: str, queue: int, start: int, lo: int, fail: bool) -> int:
    """Where to read from when ``start`` may be below the queue's minimum ``lo``: fail
    (``fail``) or skip to ``lo``. Returns the start to use."""
    if start >= lo:
        return start
    if fail:
        raise DataLossError(
            f"onceq: offsets {start}..{lo - 1} of {topic}/{queue} ({lo - start} messages) "
            "were deleted (retention) before this query read them. Set option "
            "failOnDataLoss=false to skip them, or restart the query from a new checkpoint.")
    return lo


def admit(start: Mapping[int, int], latest: Mapping[int, int], max_rows: int | None
          ) -> dict[int, int]:
    """End offsets for one micro-batch: everything up to ``latest``, or at most ``max_rows``
    messages shared fairly among the queues with a backlog (a queue with little backlog
    leaves its share to the others). ``start`` names every queue of ``latest``.
    Deterministic."""
    end = {q: max(start[q], latest[q]) if max_rows is None else start[q] for q in latest}
    if max_rows is None:
        return end
    backlog = {q: latest[q] - end[q] for q in latest if latest[q] > end[q]}
    budget = max_rows
    while budget > 0 and backlog:
        share = max(1, budget // len(backlog))
        for q in sorted(backlog):
            take = min(share, backlog[q], budget)
            end[q] += take
            backlog[q] -= take
            budget -= take
            if budget == 0:
                break
        backlog = {q: n for q, n in backlog.items() if n > 0}
    return end


def offset_key(topic: str, queue: int) -> str:
    return f"{topic}/{queue}"


def to_offsets(topic: str, positions: Mapping[int, int]) -> dict[str, int]:
    """Per-queue offsets as the checkpoint stores them: ``{"topic/queue": offset}``."""
    return {offset_key(topic, q): int(positions[q]) for q in sorted(positions)}


def from_offsets(topic: str, offsets: Mapping[str, int]) -> dict[int, int]:
    out = {}
    for key, off in offsets.items():
        t, _, q = key.rpartition("/")
        if t != topic:
            raise OptionError(f"the checkpoint holds offsets of {t!r}, not of the topic "
                              f"{topic!r}: use a new checkpoint for another topic")
        out[int(q)] = int(off)
    return out


def split_range(start: int, end: int, size: int | None) -> list[tuple[int, int]]:
    """``[start, end)`` cut into pieces of at most ``size`` (one piece when None)."""
    if end <= start:
        return []
    if size is None:
        return [(start, end)]
    return [(s, min(s + size, end)) for s in range(start, end, size)]


Bounds = Callable[[int], tuple[int, int]]
