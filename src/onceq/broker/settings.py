"""Every broker setting in one table, read from a TOML file, the environment and flags.

The keys are the fields of ``StoreConfig`` and ``BrokerConfig`` (one flat namespace) plus
the log settings; their types and defaults come from those dataclasses, so the table cannot
drift from the code. Sources, lowest first: the defaults, the config file (``--config``),
``ONCEQ_<KEY>`` environment variables, command-line flags. Every error names the key and
where its value came from; docs/config.md lists every key (a test checks it).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..storage.config import StoreConfig
from .config import BrokerConfig

ENV_PREFIX = "ONCEQ_"
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


# help text and bounds of each key (types and defaults come from the dataclasses)
_META: dict[str, tuple[str, float | None, float | None]] = {
    # store
    "data_dir": ("Directory of the commit log, indexes and state (required).", None, None),
    "segment_size": ("Commit-log segment size, bytes.", 65536, None),
    "index_entries_per_file": ("Consume-queue entries per index file.", 1, None),
    "flush": ("'sync': acknowledge a send only after fsync; 'async': fsync every "
              "flush_interval_ms.", None, None),
    "flush_interval_ms": ("Background fsync period under async flush, ms.", 1, None),
    "checkpoint_interval_ms": ("How often indexes are fsynced and checkpointed, ms.", 1, None),
    "max_body": ("Largest message body accepted, bytes.", 1, None),
    "retention_hours": ("Delete commit-log segments older than this (0: keep forever).", 0,
                        None),
    "retention_bytes": ("Delete the oldest segments above this total (0: no limit).", 0, None),
    "dedup_window_s": ("Seconds during which a retried send (same unique key) is answered "
                       "with the first send's result and not stored again (0: off).", 0, None),
    "dedup_max_keys": ("Most unique keys the dedup window holds (about 90 MB per million); "
                       "above it the oldest are forgotten early (0: off).", 0, None),
    "disk_max_used_ratio": ("Refuse writes with DISK_FULL while the data directory's file "
                            "system is used above this ratio (1: only when full).", 0, 1),
    "max_open_files": ("Index files and older segments kept open at once (0: a quarter of "
                       "the process's file-descriptor limit).", 0, None),
    # broker
    "host": ("Address the broker listens on.", None, None),
    "port": ("Port the broker listens on (0: any free port).", 0, 65535),
    "long_poll_max_s": ("Longest hold of an empty pull (long polling), seconds.", 0, None),
    "heartbeat_expiry_s": ("A member without heartbeat for this long is removed, seconds.",
                           0.001, None),
    "expiry_check_s": ("How often expired members are looked for, seconds.", 0.001, None),
    "offsets_save_s": ("How often the consumer offsets snapshot is written, seconds.", 0.001,
                       None),
    "offsets_journal_ms": ("Offset commits carried by pulls are journaled this often, ms.", 1,
                           60000),
    "retention_check_s": ("How often retention runs, seconds.", 0.001, None),
    "auto_create_topics": ("Create a topic on its first send.", None, None),
    "default_queues": ("Queues of a topic created without a count.", 1, 1024),
    "max_pull_msgs": ("Most messages one pull returns.", 1, None),
    "max_pull_bytes": ("Most bytes one pull returns.", 1, None),
    "delay_levels": ("Retry delay levels, level 1 first (RocketMQ's 18 levels).", None, None),
    "access_lock": ("Transition-state queue access lock for CLUSTERING groups.", None, None),
    "access_lock_hold_s": ("A connected holder not seen this long is displaced, seconds "
                           "(must exceed long_poll_max_s).", 0.001, None),
    "access_lock_stable_checks": ("Checks in which an idle holder's deliver offset must not "
                                  "move before its queue is handed over.", 1, None),
    "access_lock_restore_hold_s": ("After a restart, a saved holder keeps its queues this "
                                   "long unless it re-asserts or gives them up, seconds.",
                                   0.001, None),
    "max_output_bytes": ("Bytes queued for one client above which it is disconnected as a "
                         "slow consumer.", 1, None),
    "read_timeout_s": ("A frame once started must be complete within this, seconds "
                       "(0: off).", 0, None),
    "idle_timeout_s": ("A connection that sends nothing and waits for no held pull this "
                       "long is closed, seconds (0: off).", 0, None),
    "max_connections": ("Most client connections (0: as many as the fd limit allows, less "
                        "fd_reserve).", 0, None),
    "fd_reserve": ("File descriptors always left free for the broker's own files.", 16, None),
    "max_input_buffer_bytes": ("Bytes of incomplete frames buffered for all connections "
                               "together (0: the larger of 256 MiB and four frames of the "
                               "largest size).", 0, None),
    "queue_lock_expiry_s": ("An orderly queue lock not renewed this long is free, "
                            "seconds.", 0.001, None),
    "writer_expiry_s": ("An idempotent writer (the Spark sink) that sent nothing this long "
                        "is forgotten: a replay of its batches after that is stored again, "
                        "seconds.", 0.001, None),
    "metrics_port": ("Port of the Prometheus endpoint /metrics (-1: off, 0: any free "
                     "port).", -1, 65535),
    "metrics_host": ("Address the Prometheus endpoint listens on.", None, None),
    # log
    "log_level": ("Log level: DEBUG, INFO, WARNING or ERROR.", None, None),
    "log_format": ("Log format: 'text' or 'json' (one JSON object per line).", None, None),
}
_CHOICES = {"flush": ("async", "sync"), "log_level": LOG_LEVELS, "log_format": LOG_FORMATS}
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
        raise ConfigError(f"{where}: must be >= {s.min:g}, got {value!r}")
    if s.max is not None and value > s.max:
        raise ConfigError(f"{where}: must be <= {s.max:g}, got {value!r}")
    return value


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


@dataclass
class Loaded:
    broker: BrokerConfig
    log_level: str
    log_format: str
    sources: dict[str, str]  # key -> where its value came from (defaults not listed)


def load(config_file: str | None = None, environ: Mapping[str, str] | None = None,
         flags: Mapping[str, Any] | None = None) -> Loaded:
    """Merge defaults < file < environment < ``flags`` (already typed: from ``parse_text``)
    and validate the result. Raises ``ConfigError``."""
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
                  sources)
