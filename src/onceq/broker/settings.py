"""Every broker setting in one table, read from a TOML file, the environment and flags.

The keys are the fields of ``StoreConfig`` and ``BrokerConfig`` (one flat namespace) plus
the log settings; their types and defaults come from those dataclasses, so the table cannot
drift from the code. Sources, lowest first: the defaults, the config file (``--config``),
``ONCEQ_<KEY>`` environment variables, command-line flags. Every error names the key and
where its value came from; docs/config.md lists every key (a test checks it).

Every numeric key has a lower and an upper bound (in its help text). ``ONCEQ_`` variables
that are neither a key nor a client variable (``OTHER_ENV``) are returned as warnings, with
the closest known name: a misspelled setting must not silently leave its default.
``preflight`` checks at start what only the host can tell (the data directory, the listen
addresses, the descriptor limit), each error naming its key.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import math
import os
import socket
import tempfile
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..log.delay import MAX_DELAY_SETTING_S
from ..storage.config import StoreConfig
from ..storage.openfiles import default_capacity
from ..storage.topics import MAX_QUEUES
from .config import BrokerConfig
from .limits import fd_limit
from .retry import parse_delay_levels
from .tls import metrics_context, server_context

ENV_PREFIX = "ONCEQ_"
# ONCEQ_ variables that are not broker settings: the client commands' (cli/common.py,
# cli/dedup_cmd.py) and the config file's
OTHER_ENV = frozenset({"ONCEQ_BROKER", "ONCEQ_CONFIG", "ONCEQ_DEDUP_STORE"})
KIB = 1024
GIB = 1024 ** 3
DAY_S = 86400
MAX_FDS = 1 << 20  # Linux's default ceiling of any process's descriptor limit (nr_open)
# delay levels: one %SCHEDULE% queue each, so at most a topic's queue count; each delay at
# most a year (RocketMQ's longest default level is 2h), far inside a due time in ms
MAX_DELAY_LEVELS = MAX_QUEUES
MAX_DELAY_S = 365 * DAY_S
# descriptors left for client connections at start, beyond fd_reserve, the index-file
# cache and about 32 of the broker's own (segment, journals, listening sockets, stdio)
BROKER_OWN_FDS = 32
MIN_CLIENT_FDS = 16
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the key and its source."""


@dataclass(frozen=True)
class Setting:
    key: str
    type: type  # bool, int, float or str
    default: Any  # None: required
    section: str  # "store", "broker" or "log"
    help: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()

    @property
    def flag(self) -> str:
        """``--key-with-dashes``, without a trailing ``_s`` (seconds are the default unit)."""
        name = self.key[:-2] if self.key.endswith("_s") else self.key
        return "--" + name.replace("_", "-")


# help text and bounds of each key (types and defaults come from the dataclasses); every
# numeric key has both bounds, written into its help (a test checks both are set)
_META: dict[str, tuple[str, float | None, float | None]] = {
    # store
    "data_dir": ("Directory of the commit log, indexes and state (required).", None, None),
    "segment_size": ("Commit-log segment size, bytes (64 KiB..16 GiB).", 64 * KIB, 16 * GIB),
    "index_entries_per_file": ("Consume-queue entries per index file (1..10,000,000; 24 "
                               "bytes each).", 1, 10_000_000),
    "flush": ("'sync': acknowledge a send only after fsync; 'async': fsync every "
              "flush_interval_ms.", None, None),
    "flush_interval_ms": ("Background fsync period under async flush, ms (1..60000).", 1,
                          60_000),
    "checkpoint_interval_ms": ("How often indexes are fsynced and checkpointed, ms "
                               "(1..3600000: one hour).", 1, 3_600_000),
    "max_body": ("Largest message body accepted, bytes (1..1 GiB, and at least 4 KiB below "
                 "segment_size).", 1, 1 * GIB),
    "retention_hours": ("Delete commit-log segments older than this (0: keep forever; at "
                        "most 87600, ten years).", 0, 87_600),
    "retention_bytes": ("Delete the oldest segments above this total (0: no limit; at most "
                        "1 PiB).", 0, 1 << 50),
    "dedup_window_s": ("Seconds during which a retried send (same unique key) is answered "
                       "with the first send's result and not stored again (0: off; at most "
                       "86400, one day).", 0, DAY_S),
    "dedup_max_keys": ("Most unique keys the dedup window holds (about 90 MB per million); "
                       "above it the oldest are forgotten early (0: off; at most "
                       "100,000,000).", 0, 100_000_000),
    "disk_max_used_ratio": ("Refuse writes with DISK_FULL while the data directory's file "
                            "system is used above this ratio (above 0, at most 1; 1: only "
                            "when full).", 0, 1),
    "max_open_files": ("Index files and older segments kept open at once (0: a quarter of "
                       "the process's file-descriptor limit; at most 1,048,576, and with "
                       "fd_reserve well below the fd limit).", 0, MAX_FDS),
    # broker
    "host": ("Address the broker listens on.", None, None),
    "port": ("Port the broker listens on (0: any free port; at most 65535).", 0, 65535),
    "long_poll_max_s": ("Longest hold of an empty pull (long polling), seconds (0..3600).",
                        0, 3600),
    "heartbeat_expiry_s": ("A member without heartbeat for this long is removed, seconds "
                           "(0.001..86400).", 0.001, DAY_S),
    "expiry_check_s": ("How often expired members are looked for, seconds (0.001..86400).",
                       0.001, DAY_S),
    "offsets_save_s": ("How often the consumer offsets snapshot is written, seconds "
                       "(0.001..86400).", 0.001, DAY_S),
    "offsets_journal_ms": ("Offset commits carried by pulls are journaled this often, ms "
                           "(1..60000).", 1, 60000),
    "retention_check_s": ("How often retention runs, seconds (0.001..86400).", 0.001, DAY_S),
    "auto_create_topics": ("Create a topic on its first send.", None, None),
    "default_queues": ("Queues of a topic created without a count (1..1024).", 1, 1024),
    "fuse_depth": ("Queue-depth fuse: refuse sends (QUEUE_FULL, retriable) to a queue its "
                   "slowest consumer group is this many messages behind on (0: off; at "
                   "most 2**40).",
                   0, 1 << 40),
    "fuse_topics": ("The fuse's depth per topic, 'topic=depth,...' (0: none for that "
                    "topic), over fuse_depth.", None, None),
    "fuse_resume_ratio": ("A tripped fuse takes sends again once the depth is at most this "
                          "share of its limit (0..0.99).", 0, 0.99),
    "max_pull_msgs": ("Most messages one pull returns (1..65536).", 1, 65536),
    "max_pull_bytes": ("Most bytes one pull returns (1..1 GiB).", 1, 1 * GIB),
    "delay_levels": ("Retry delay levels, level 1 first (RocketMQ's 18 levels; 1..1024 "
                     "levels, one schedule queue each, each at most 365d).", None, None),
    "timer_max_delay_s": ("Delayed messages: the furthest delivery time accepted, seconds "
                          "ahead (further: INVALID_ARGUMENT; 1..31536000, a year; "
                          "docs/delayed.md).", 1, MAX_DELAY_SETTING_S),
    "access_lock": ("Transition-state queue access lock for CLUSTERING groups.", None, None),
    "access_lock_hold_s": ("A connected holder not seen this long is displaced, seconds "
                           "(must exceed long_poll_max_s; at most 86400).", 0.001, DAY_S),
    "access_lock_stable_checks": ("Checks in which an idle holder's deliver offset must not "
                                  "move before its queue is handed over (1..100).", 1, 100),
    "access_lock_restore_hold_s": ("After a restart, a saved holder keeps its queues this "
                                   "long unless it re-asserts or gives them up, seconds "
                                   "(0.001..86400).", 0.001, DAY_S),
    "queue_scaling_grace_s": ("After a topic that follows a group changes its write "
                              "count, producers may write with the old count this long, "
                              "seconds (keep it above the producers' 5 s refresh; at most "
                              "86400).", 0, DAY_S),
    "queue_scaling_settle_s": ("A group's size must hold this long before the queues of "
                               "the topics following it change, seconds (at most 86400).",
                               0, DAY_S),
    "max_output_bytes": ("Bytes queued for one client above which it is disconnected as a "
                         "slow consumer (at most 16 GiB).", 1, 16 * GIB),
    "read_timeout_s": ("A frame once started must be complete within this, seconds "
                       "(0: off; at most 86400).", 0, DAY_S),
    "idle_timeout_s": ("A connection that sends nothing and waits for no held pull this "
                       "long is closed, seconds (0: off; at most 86400).", 0, DAY_S),
    "max_connections": ("Most client connections (0: as many as the fd limit allows, less "
                        "fd_reserve; at most 1,048,576).", 0, MAX_FDS),
    "fd_reserve": ("File descriptors always left free for the broker's own files (16..65536, "
                   "and at start well below the process's fd limit).", 16, 65536),
    "max_input_buffer_bytes": ("Bytes of incomplete frames buffered for all connections "
                               "together (0: the larger of 256 MiB and four frames of the "
                               "largest size; at most 64 GiB).", 0, 64 * GIB),
    "queue_lock_expiry_s": ("An orderly queue lock not renewed this long is free, "
                            "seconds (0.001..86400).", 0.001, DAY_S),
    "writer_expiry_s": ("An idempotent writer (the Spark sink) that sent nothing this long "
                        "is forgotten: a replay of its batches after that is stored again, "
                        "seconds (0.001..2592000: 30 days).", 0.001, 30 * DAY_S),
    "metrics_port": ("Port of the Prometheus endpoint /metrics (-1: off, 0: any free "
                     "port; at most 65535).", -1, 65535),
    "metrics_host": ("Address the Prometheus endpoint listens on.", None, None),
    "metrics_tls": ("Serve /metrics over TLS with tls_cert and tls_key (no client "
                    "certificates asked).", None, None),
    "grpc_port": ("Port of the RocketMQ 5 gRPC endpoint on host, for the official RocketMQ "
                  "clients (0: off; at most 65535; the grpc extra; docs/rocketmq.md).", 0,
                  65535),
    # security
    "acl": ("Users authenticate (SCRAM-SHA-256 or a client certificate) and every request "
            "is checked against the ACL grants (docs/security.md).", None, None),
    "insecure": ("Allow listening on an address beyond loopback with acl off (anyone who "
                 "reaches the port can do anything).", None, None),
    "tls_cert": ("Server certificate (PEM) of the client port: TLS on when set.", None, None),
    "tls_key": ("Private key (PEM) of tls_cert.", None, None),
    "tls_client_ca": ("CA certificate (PEM) of client certificates: a client certificate's "
                      "subject CN is its user.", None, None),
    "tls_client_auth": ("Client certificates: 'none', 'optional' or 'required'.", None, None),
    "audit_log": ("File of the audit log, JSON lines (empty: audit.log in data_dir when acl "
                  "is on).", None, None),
    # broker groups
    "cluster": ("etcd endpoints of a broker group, etcd://host:port[,host:port...] "
                "(empty: a standalone broker; docs/cluster.md).", None, None),
    "cluster_name": ("Name of the cluster in etcd (keys under /onceq/<name>/).", None, None),
    "group": ("The broker group this broker replicates (with cluster).", None, None),
    "broker_id": ("This broker's id in its group (with cluster).", None, None),
    "advertised_address": ("host:port the other brokers and clients reach this broker at "
                           "(empty: host:port).", None, None),
    "session_ttl_s": ("TTL of the broker's etcd lease, seconds (1..300): a leader that "
                      "cannot renew it steps down before it expires.", 1, 300),
    "acks": ("When a write is acknowledged in a group: 'all' (the in-sync replicas have "
             "it, at least min_insync of them) or 'leader' (the leader's log only: the "
             "tail may be lost at a failover).", None, None),
    "min_insync": ("In-sync replicas, the leader included, needed to accept a write with "
                   "acks=all (1..100).", 1, 100),
    "replication_credentials_file": ("With acl on: a file whose first line is "
                                     "user:password, the user this broker logs in to its "
                                     "group's leader with to replicate (it needs the "
                                     "cluster's Update grant, or is a super user).",
                                     None, None),
    "replication_tls_ca": ("CA certificate (PEM) of the leader's certificate when the "
                           "brokers speak TLS (tls_cert): followers verify it (empty: the "
                           "system's CAs).", None, None),
    "unclean_election": ("Let any replica of the group be elected leader, not only the "
                         "in-sync ones: the group gets a leader sooner when the in-sync "
                         "replicas are gone, but acknowledged writes the new leader lacks "
                         "are lost.", None, None),
    "replica_lag_max_ms": ("A follower not caught up with the leader for this long leaves "
                           "the in-sync replicas, ms (1..3600000).", 1, 3_600_000),
    "replica_ack_timeout_ms": ("A write not replicated within this is answered "
                               "NOT_ENOUGH_REPLICAS, ms (1..3600000).", 1, 3_600_000),
    "replica_fetch_wait_ms": ("A follower's fetch waits this long for new records, ms "
                              "(0..60000).", 0, 60_000),
    "replica_fetch_bytes": ("Bytes of records a fetch answer carries (about; at least one "
                            "record), 4 KiB..64 MiB.", 4 * KIB, 64 * 1024 * KIB),
    # log
    "log_level": ("Log level: DEBUG, INFO, WARNING or ERROR.", None, None),
    "log_format": ("Log format: 'text' or 'json' (one JSON object per line).", None, None),
}
_CHOICES = {"flush": ("async", "sync"), "log_level": LOG_LEVELS, "log_format": LOG_FORMATS,
            "tls_client_auth": ("none", "optional", "required"), "acks": ("all", "leader")}
_LOG_DEFAULTS = {"log_level": "INFO", "log_format": "text"}
_SKIP = {"store", "extra"}  # not settings: the nested store config, programmatic extras


def _settings() -> tuple[Setting, ...]:
    out = []
    for section, cls in (("store", StoreConfig), ("broker", BrokerConfig)):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in _SKIP:
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = None  # required
            help_, lo, hi = _META.get(f.name, ("(undocumented)", None, None))
            out.append(Setting(f.name, hints[f.name], default, section, help_, lo, hi,
                               _CHOICES.get(f.name)))
    for key, default in _LOG_DEFAULTS.items():
        out.append(Setting(key, str, default, "log", _META[key][0], choices=_CHOICES[key]))
    return tuple(out)


SETTINGS: tuple[Setting, ...] = _settings()
BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _type_name(s: Setting) -> str:
    return _TYPE_NAMES.get(s.type) or getattr(s.type, "__name__", str(s.type))


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _typed(s: Setting, value: Any, where: str) -> Any:
    """``value`` checked against the key's type, choices and bounds."""
    if s.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, s.type) or (s.type is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {_type_name(s)}, got {value!r}")
    if s.type is float and not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number, got {value!r}")
    if s.choices is not None:
        v = value.upper() if s.key == "log_level" else value
        if v not in s.choices:
            raise ConfigError(f"{where}: must be one of {', '.join(s.choices)}, got {value!r}")
        value = v
    if s.min is not None and value < s.min:
        raise ConfigError(f"{where}: must be >= {_num(s.min)}, got {value!r}")
    if s.max is not None and value > s.max:
        raise ConfigError(f"{where}: must be <= {_num(s.max)}, got {value!r}")
    if s.key == "delay_levels":
        check_delay_levels(value, where)
    return value


def check_delay_levels(spec: str, where: str = "delay_levels") -> list[float]:
    """The delays of ``spec`` (seconds), or ConfigError naming ``where``: 1..1024 levels
    (the schedule topic has one queue per level), each 0..365 days."""
    try:
        levels = parse_delay_levels(spec)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if len(levels) > MAX_DELAY_LEVELS:
        raise ConfigError(f"{where}: at most {MAX_DELAY_LEVELS} delay levels (one schedule "
                          f"queue each), got {len(levels)}")
    for i, delay in enumerate(levels, 1):
        if not delay <= MAX_DELAY_S:
            raise ConfigError(f"{where}: level {i} is longer than 365d ({MAX_DELAY_S} s), "
                              f"got {spec.split()[i - 1]!r}")
    return levels


def parse_text(s: Setting, text: str, where: str) -> Any:
    """A value given as text (environment variable, flag) converted to the key's type."""
    t = text.strip()
    value: Any = t
    try:
        if s.type is bool:
            if t.lower() not in _TRUE + _FALSE:
                raise ValueError
            value = t.lower() in _TRUE
        elif s.type is int:
            value = int(t.replace("_", ""))
        elif s.type is float:
            value = float(t)
        elif s.type is not str:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{where}: expected {_type_name(s)}, got {text!r}") from None
    return _typed(s, value, where)


def read_file(path: str) -> dict[str, Any]:
    """The settings of a TOML file: flat ``key = value`` lines (see docs/config.md)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
    out = {}
    for key, value in data.items():
        where = f"config file {path}: key {key!r}"
        s = BY_KEY.get(key)
        if s is None:
            hint = " (keys are flat: no [sections])" if isinstance(value, dict) else ""
            raise ConfigError(f"{where}: unknown key{hint}; see docs/config.md")
        out[key] = _typed(s, value, where)
    return out


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """``ONCEQ_<KEY>`` variables of known keys (other ONCEQ_ variables are for the clients)."""
    return {s.key: parse_text(s, environ[s.env], f"environment {s.env}")
            for s in SETTINGS if s.env in environ}


_ENV_NAMES = {s.env for s in SETTINGS}


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``ONCEQ_`` variable that is neither a setting nor a client
    variable (``OTHER_ENV``): a misspelled setting would otherwise be silently ignored."""
    known = sorted(n[len(ENV_PREFIX):] for n in _ENV_NAMES | OTHER_ENV)
    out = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in _ENV_NAMES or name in OTHER_ENV:
            continue
        # compared without the prefix, which every name shares
        close = difflib.get_close_matches(name[len(ENV_PREFIX):], known, n=1)
        hint = f" (did you mean {ENV_PREFIX}{close[0]}?)" if close else ""
        out.append(f"environment {name}: not a setting, ignored{hint}; see docs/config.md")
    return out


@dataclass
class Loaded:
    broker: BrokerConfig
    log_level: str
    log_format: str
    sources: dict[str, str]  # key -> where its value came from (defaults not listed)
    warnings: list[str] = dataclasses.field(default_factory=list)  # unknown ONCEQ_ variables


def load(config_file: str | None = None, environ: Mapping[str, str] | None = None,
         flags: Mapping[str, Any] | None = None) -> Loaded:
    """Merge defaults < file < environment < ``flags`` (already typed: from ``parse_text``)
    and validate the result. Raises ``ConfigError``. Unknown ``ONCEQ_`` variables are
    listed in ``warnings`` (``onceq broker start`` logs them at WARNING)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {s.key: s.default for s in SETTINGS}
    sources: dict[str, str] = {}
    layers = []
    if config_file is not None:
        layers.append((read_file(config_file), f"config file {config_file}"))
    layers.append((read_env(environ), "environment"))
    layers.append((dict(flags or {}), "command line"))
    for layer, name in layers:
        for key, value in layer.items():
            values[key] = value
            sources[key] = name
    if not values["data_dir"]:
        raise ConfigError("data_dir is required: --data-dir, ONCEQ_DATA_DIR or data_dir in "
                          "the config file")
    by_section: dict[str, dict[str, Any]] = {"store": {}, "broker": {}, "log": {}}
    for s in SETTINGS:
        by_section[s.section][s.key] = values[s.key]
    store = StoreConfig(**by_section["store"])
    cfg = BrokerConfig(store, **by_section["broker"])
    try:
        cfg.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return Loaded(cfg, by_section["log"]["log_level"], by_section["log"]["log_format"],
                  sources, unknown_env(environ))


# ---------------------------------------------------------------- checks at start
def check_data_dir(path: str) -> None:
    """``data_dir`` is (or can be made) a directory the broker can write in."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"data_dir: {path} exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"data_dir: cannot create {path}: {exc.strerror}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".onceq-write-check-", dir=path)
    except OSError as exc:
        raise ConfigError(f"data_dir: cannot write in {path}: {exc.strerror}") from None
    os.close(fd)
    os.unlink(probe)


def check_host(key: str, host: str) -> None:
    """``host`` resolves to at least one address of this machine (a bind to a free port
    there succeeds), as the listener will need."""
    try:
        infos = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ConfigError(f"{key}: cannot resolve {host!r}: {reason}") from None
    first: OSError | None = None
    for family, type_, proto, _name, addr in infos:
        try:
            with socket.socket(family, type_, proto) as sock:
                sock.bind(addr)
            return
        except OSError as exc:
            first = first or exc
    why = ("not an address of this machine" if first is not None
           and first.errno == errno.EADDRNOTAVAIL else
           first.strerror if first is not None else "no address")
    raise ConfigError(f"{key}: cannot listen on {host!r}: {why}")


def check_fds(cfg: BrokerConfig, soft_limit: int | None = None) -> None:
    """``fd_reserve`` and the index-file cache leave descriptors for clients under the
    process's soft ``RLIMIT_NOFILE``; else every client would be refused."""
    limit = fd_limit() if soft_limit is None else soft_limit
    cache = cfg.store.max_open_files or default_capacity(limit)
    left = limit - cfg.fd_reserve - cache - BROKER_OWN_FDS
    if left < MIN_CLIENT_FDS:
        cache_is = (f"max_open_files {cache}" if cfg.store.max_open_files else
                    f"the index-file cache ({cache}, from the limit)")
        raise ConfigError(f"fd_reserve: {cfg.fd_reserve} and {cache_is} leave {max(left, 0)} "
                          f"of the process's {limit} file descriptors (ulimit -n) for "
                          f"clients, less than {MIN_CLIENT_FDS}: lower fd_reserve or "
                          f"max_open_files, or raise the limit")


def preflight(cfg: BrokerConfig, soft_limit: int | None = None) -> None:
    """What only the host can tell, checked before the broker opens anything: the data
    directory, the listen addresses and the descriptor limit. Raises ``ConfigError``
    naming the key."""
    check_data_dir(cfg.store.data_dir)
    check_host("host", cfg.host)
    try:
        cfg.check_exposure()
    except ValueError as exc:
        raise ConfigError(f"host: {exc}") from None
    if cfg.metrics_port >= 0:
        check_host("metrics_host", cfg.metrics_host)
    try:
        server_context(cfg)  # the certificate, key and client CA load
        metrics_context(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_fds(cfg, soft_limit)
