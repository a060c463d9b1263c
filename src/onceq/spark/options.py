"""The source's options and offsets, as plain data (no pyspark, no sockets).

A query reads one ``topic``, a list of ``topics`` or every topic matching ``topicPattern``
(as the Kafka source's assign/subscribe/subscribePattern). Queues are named
``(topic, queue)``. The checkpoint's offsets and a start or end position given as JSON are
keyed by topic, then queue (``{"orders": {"0": 23, "1": -2}}``; in a position -2 is the
earliest offset, -1 the latest; a position may also be ``"earliest"`` or ``"latest"``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..client.security import ClientSecurity, CredentialsError, read_credentials_file

EARLIEST = -2
LATEST = -1

# A queue of a topic.
TopicQueue = tuple[str, int]
# Positions per topic, then per queue: EARLIEST, LATEST or an offset.
Positions = Mapping[str, Mapping[int, int]]

BODY_FORMATS = ("binary", "json")


class OptionError(ValueError):
    """An option the source cannot use; the message names the option."""


class DataLossError(RuntimeError):
    """Offsets the query still had to read were deleted (retention) or lost (damage)."""


@dataclass(frozen=True, slots=True)
class SourceOptions:
    servers: str
    topics: tuple[str, ...]  # the topics named (empty with a pattern)
    topic_pattern: str | None  # a regular expression the whole topic name matches
    queues: tuple[int, ...] | None  # None: all queues (one topic only)
    starting: str | Positions  # "earliest", "latest" or positions per queue
    ending: str | Positions
    starting_timestamp: int | None  # epoch ms; wins over ``starting``
    max_messages_per_trigger: int | None
    max_messages_per_partition: int | None
    fail_on_data_loss: bool
    group: str
    pull_batch: int
    verify_checksums: bool
    body_format: str = "binary"  # or "json": decoded with body_schema
    body_schema: str | None = None  # Spark DDL of the decoded columns
    include_body: bool = True  # keep the body column beside the decoded ones
    read_timeout_s: int = 60  # how long the broker may fail every attempt (retry.py)
    security: ClientSecurity | None = None  # None: from the environment (ONCEQ_USER...)

    def subscribes(self, topic: str) -> bool:
        return _reads(self.topics, self.topic_pattern, topic)

    @property
    def label(self) -> str:
        """The topics, for messages."""
        return ",".join(self.topics) or f"/{self.topic_pattern}/"

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool) -> SourceOptions:
        """Options as Spark passes them (strings, keys in any case)."""
        opts = {k.lower(): v for k, v in options.items()}
        topics, pattern = _subscription(opts)
        queues = None
        if opts.get("queues", "").strip():
            if len(topics) != 1:
                raise OptionError("option 'queues' needs a single 'topic'")
            try:
                queues = tuple(sorted({int(q) for q in opts["queues"].split(",") if q.strip()}))
            except ValueError:
                raise OptionError("option 'queues' must be queue numbers separated by commas,"
                                  f" not {opts['queues']!r}") from None
            if not queues or min(queues) < 0:
                raise OptionError(f"option 'queues' has no valid queue: {opts['queues']!r}")
        def reads(topic: str) -> bool:
            return _reads(topics, pattern, topic)

        starting = _positions(opts.get("startingoffsets", "latest" if streaming else "earliest"),
                              reads, "startingOffsets")
        ending = _positions(opts.get("endingoffsets", "latest"), reads, "endingOffsets")
        if streaming and "endingoffsets" in opts:
            raise OptionError("option 'endingOffsets' is for batch reads only")
        ts = _int_option(opts, "startingtimestamp", None, "startingTimestamp", minimum=0)
        max_trigger = _int_option(opts, "maxmessagespertrigger", None, "maxMessagesPerTrigger",
                                  minimum=1)
        if max_trigger is None:  # the name users know from the Kafka source
            max_trigger = _int_option(opts, "maxoffsetspertrigger", None,
                                      "maxOffsetsPerTrigger", minimum=1)
        body_format, body_schema, include_body = _body_options(opts)
        return cls(
            servers=opts.get("servers", "127.0.0.1:9876"),
            topics=topics,
            topic_pattern=pattern,
            queues=queues,
            starting=starting,
            ending=ending,
            starting_timestamp=ts,
            max_messages_per_trigger=max_trigger,
            max_messages_per_partition=_int_option(opts, "maxmessagesperpartition", None,
                                                   "maxMessagesPerPartition", minimum=1),
            fail_on_data_loss=_bool_option(opts, "failondataloss", True, "failOnDataLoss"),
            group=opts.get("group") or default_group(topics, opts),
            pull_batch=_int_option(opts, "pullbatchsize", 1024, "pullBatchSize", minimum=1),
            verify_checksums=_bool_option(opts, "verifychecksums", True, "verifyChecksums"),
            body_format=body_format,
            body_schema=body_schema,
            include_body=include_body,
            read_timeout_s=_int_option(opts, "readtimeout", 60, "readTimeout", minimum=1) or 60,
            security=security_options(opts),
        )


def _reads(topics: tuple[str, ...], pattern: str | None, topic: str) -> bool:
    return topic in topics if pattern is None else re.fullmatch(pattern, topic) is not None


def _subscription(opts: Mapping[str, str]) -> tuple[tuple[str, ...], str | None]:
    """(topics, pattern) from exactly one of ``topic``, ``topics``, ``topicPattern``."""
    given = [k for k in ("topic", "topics", "topicpattern") if opts.get(k, "").strip()]
    if len(given) != 1:
        raise OptionError("give exactly one of the options 'topic', 'topics' (names separated "
                          "by commas) or 'topicPattern' (a regular expression)"
                          + (f", not {len(given)}" if given else ""))
    raw = opts[given[0]].strip()
    if given[0] == "topicpattern":
        try:
            re.compile(raw)
        except re.error as exc:
            raise OptionError(f"option 'topicPattern' is not a regular expression: {exc}"
                              ) from None
        return (), raw
    topics = tuple(dict.fromkeys(t.strip() for t in raw.split(",") if t.strip()))
    if not topics:
        raise OptionError(f"option 'topics' names no topic: {raw!r}")
    return topics, None


def _body_options(opts: Mapping[str, str]) -> tuple[str, str | None, bool]:
    fmt = opts.get("bodyformat", "binary").strip().lower()
    if fmt not in BODY_FORMATS:
        raise OptionError(f"option 'bodyFormat' must be binary or json, not {fmt!r}")
    schema = opts.get("bodyschema", "").strip() or None
    if fmt == "json" and schema is None:
        raise OptionError("option 'bodyFormat' json needs 'bodySchema', the decoded columns "
                          "in Spark DDL (e.g. 'order_id STRING, quantity INT')")
    if fmt == "binary" and schema is not None:
        raise OptionError("option 'bodySchema' needs bodyFormat=json")
    keep = _bool_option(opts, "includebody", True, "includeBody")
    if fmt == "binary" and not keep:
        raise OptionError("option 'includeBody' false needs bodyFormat=json")
    return fmt, schema, keep


def default_group(topics: tuple[str, ...], opts: Mapping[str, str]) -> str:
    """A stable group name for a query that sets none: the topic and a hash of the options
    that define what it reads (a restarted query reports under the same name)."""
    keys = ["servers", "topic", "queues", "startingoffsets", "startingtimestamp"]
    keys += [k for k in ("topics", "topicpattern") if k in opts]
    ident = json.dumps({k: opts.get(k) for k in keys}, sort_keys=True)
    digest = hashlib.sha1(ident.encode()).hexdigest()[:10]
    name = topics[0] if len(topics) == 1 else "topics" if topics else "pattern"
    return f"spark-{name}-{digest}"[:127]


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


SECURITY_OPTIONS = ("user", "password", "credentialsfile", "tls", "tlsca")


def security_options(opts: Mapping[str, str]) -> ClientSecurity | None:
    """The user and TLS of the connections to the broker, from the options ``user`` and
    ``password`` (Spark redacts an option named password in its plans and UI),
    ``credentialsFile`` (a file whose first line is ``user:password``, read on the driver),
    ``tls`` (``true``: connect with TLS, verifying the broker) and ``tlsCa`` (the CA of the
    broker's certificate). None when no option names them: the clients then read the
    environment of the driver and executors (``ONCEQ_USER``, ``ONCEQ_PASSWORD``...)."""
    if not any(k in opts for k in SECURITY_OPTIONS):
        return None
    user, password = opts.get("user") or None, opts.get("password") or None
    path = opts.get("credentialsfile")
    if path and user is None:
        try:
            user, password = read_credentials_file(path)
        except CredentialsError as exc:
            raise OptionError(f"option 'credentialsFile': {exc}") from None
    if (user is None) != (password is None):
        raise OptionError("options 'user' and 'password' go together")
    ca = opts.get("tlsca") or None
    tls = _bool_option(opts, "tls", ca is not None, "tls")
    return ClientSecurity(user, password, tls, ca)


def _bool_option(opts: Mapping[str, str], key: str, default: bool, name: str) -> bool:
    raw = opts.get(key)
    if raw is None:
        return default
    if raw.strip().lower() in ("true", "1", "yes"):
        return True
    if raw.strip().lower() in ("false", "0", "no"):
        return False
    raise OptionError(f"option {name!r} must be true or false, not {raw!r}")


def _positions(raw: str, subscribes: Callable[[str], bool], name: str
               ) -> str | dict[str, dict[int, int]]:
    text = raw.strip()
    if text.lower() in ("earliest", "latest"):
        return text.lower()
    try:
        parsed = json.loads(text)
    except ValueError:
        raise OptionError(f"option {name!r} must be 'earliest', 'latest' or JSON like "
                          f'{{"orders": {{"0": 42}}}}, not {raw!r}') from None
    if not isinstance(parsed, dict) or not all(isinstance(v, dict) for v in parsed.values()):
        raise OptionError(f"option {name!r} must map topics to positions per queue, "
                          f"not {raw!r}")
    other = sorted(t for t in parsed if not subscribes(t))
    if other:
        raise OptionError(f"option {name!r} names topics the query does not read: {other}")
    try:
        out = {t: {int(q): int(off) for q, off in per.items()} for t, per in parsed.items()}
    except (TypeError, ValueError):
        raise OptionError(f"option {name!r}: queues and offsets must be integers") from None
    if any(q < 0 or off < EARLIEST for per in out.values() for q, off in per.items()):
        raise OptionError(f"option {name!r}: offsets are >= 0, -2 (earliest) or -1 (latest)")
    return out


def resolve(spec: str | Positions, tq: TopicQueue, bounds: tuple[int, int]) -> int:
    """The offset a position names on a queue with ``bounds`` (min, max); a queue the JSON
    does not name starts at the earliest offset (as a queue added later does)."""
    lo, hi = bounds
    if spec == "earliest":
        return lo
    if spec == "latest":
        return hi
    assert isinstance(spec, Mapping)
    pos = spec.get(tq[0], {}).get(tq[1], EARLIEST)
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


def admit(start: Mapping[TopicQueue, int], latest: Mapping[TopicQueue, int],
          max_rows: int | None) -> dict[TopicQueue, int]:
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


def to_offsets(positions: Mapping[TopicQueue, int]) -> dict[str, dict[str, int]]:
    """Per-queue offsets as the checkpoint stores them: ``{"topic": {"queue": offset}}``."""
    out: dict[str, dict[str, int]] = {}
    for t, q in sorted(positions):
        out.setdefault(t, {})[str(q)] = int(positions[t, q])
    return out


def from_offsets(opts: SourceOptions, offsets: Mapping[str, Any]) -> dict[TopicQueue, int]:
    """``to_offsets`` reversed; also reads ``{"topic/queue": offset}``, the form of
    checkpoints written by earlier versions."""
    out = {}
    for key, value in offsets.items():
        if isinstance(value, Mapping):
            entries = [(key, q, off) for q, off in value.items()]
        else:
            t, _, q = key.rpartition("/")
            entries = [(t, q, value)]
        for t, q, off in entries:
            if not opts.subscribes(t):
                raise OptionError(f"the checkpoint holds offsets of {t!r}, which the query "
                                  f"does not read ({opts.label}): use a new checkpoint for "
                                  "other topics")
            out[t, int(q)] = int(off)
    return out


def split_range(start: int, end: int, size: int | None) -> list[tuple[int, int]]:
    """``[start, end)`` cut into pieces of at most ``size`` (one piece when None)."""
    if end <= start:
        return []
    if size is None:
        return [(start, end)]
    return [(s, min(s + size, end)) for s in range(start, end, size)]


Bounds = Callable[[int], tuple[int, int]]
