"""``onceq broker start``: one flag per setting of ``broker/settings.py``, on top of the
config file (``--config``) and the ``ONCEQ_<KEY>`` environment variables."""

from __future__ import annotations

import errno
import json
import logging
import os
from typing import Any

import click

from ..broker.settings import (
    SETTINGS,
    ConfigError,
    Loaded,
    Setting,
    load,
    parse_text,
    preflight,
)
from ..logconfig import setup_logging

EXIT_CONFIG = 2  # a setting that cannot be used (same code as any usage error)
_SHORT = {"data_dir": "-d", "port": "-p"}
_METAVAR = {int: "INT", float: "NUMBER", str: "TEXT"}
# errors on a file of the data directory that are the directory's fault, not the disk's
_DATA_DIR_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EROFS,
                    errno.EEXIST}


class ConfigProblem(click.ClickException):
    exit_code = EXIT_CONFIG

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def _option(s: Setting) -> Any:
    names = [s.flag] + ([_SHORT[s.key]] if s.key in _SHORT else [])
    default = "required" if s.default is None else toml_value(s.default)
    help_ = f"{s.help} [default: {default}; env {s.env}; key {s.key}]"
    if s.type is bool:
        name = s.flag[2:]
        return click.option(f"--{name}/--no-{name}", s.key, default=None, help=help_)
    metavar = "|".join(s.choices) if s.choices else _METAVAR.get(s.type, "VALUE")
    return click.option(*names, s.key, default=None, metavar=metavar, help=help_)


def _typed_flags(values: dict[str, Any]) -> dict[str, Any]:
    flags = {}
    for s in SETTINGS:
        v = values.get(s.key)
        if v is None:
            continue
        flags[s.key] = v if isinstance(v, bool) else parse_text(s, v, s.flag)
    return flags


def _data_dir_error(exc: OSError, data_dir: str) -> bool:
    """Whether ``exc`` is about a file of the data directory that cannot be used as one."""
    if exc.errno not in _DATA_DIR_ERRNOS or not isinstance(exc.filename, str):
        return False
    root = os.path.abspath(data_dir)
    path = os.path.abspath(exc.filename)
    return path == root or path.startswith(root + os.sep)


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v) if isinstance(v, str) else repr(v)


def to_toml(loaded: Loaded) -> str:
    """The effective settings as a config file, each with where it came from."""
    cfg = loaded.broker
    values = {**vars(cfg.store), **vars(cfg), "log_level": loaded.log_level,
              "log_format": loaded.log_format}
    lines = []
    for s in SETTINGS:
        lines.append(f"{s.key} = {toml_value(values[s.key])}  "
                     f"# {loaded.sources.get(s.key, 'default')}")
    return "\n".join(lines)


def _front_ends(cfg: Any) -> list[Any]:
    """The front ends the settings ask for: the RocketMQ gRPC endpoint (``grpc_port``)."""
    if not cfg.grpc_port:
        return []
    try:
        from ..rocketmq.server import GrpcFrontEnd
    except ImportError as exc:
        raise ConfigProblem(f"grpc_port: the RocketMQ endpoint needs the grpc extra (pip "
                            f"install 'onceq[grpc]'): {exc}") from None
    return [GrpcFrontEnd(cfg.grpc_port)]


def make_start_command() -> click.Command:
    def start(config: str | None, print_config: bool, **values: Any) -> None:
        """Start a broker in the foreground (SIGTERM or Ctrl-C flushes and stops it).

        Settings come from, lowest first: their defaults, the TOML file given with
        --config (or ONCEQ_CONFIG), ONCEQ_<KEY> environment variables, these flags.
        Every key is described in docs/config.md."""
        from ..broker.server import run

        ctx = click.get_current_context()
        inherited = (ctx.find_root().obj or {}).get("log", {})  # onceq --log-level ...
        try:
            flags = {**inherited, **_typed_flags(values)}
            loaded = load(config, flags=flags)
        except ConfigError as exc:
            raise ConfigProblem(str(exc)) from None
        if print_config:
            for w in loaded.warnings:
                click.echo(f"warning: {w}", err=True)
            click.echo(to_toml(loaded))
            return
        setup_logging(loaded.log_level, loaded.log_format)
        for w in loaded.warnings:  # a misspelled ONCEQ_ variable is not silently ignored
            logging.getLogger("onceq.broker").warning("%s", w)
        cfg = loaded.broker
        try:
            preflight(cfg)
        except ConfigError as exc:
            raise ConfigProblem(str(exc)) from None

        front_ends = _front_ends(cfg)

        def ready(b: Any) -> None:
            if loaded.log_format == "json":  # stderr stays one JSON object per line
                return
            metrics = f", metrics :{b.metrics.port}" if b.metrics is not None else ""
            metrics += "".join(f", {f.name} :{f.port}" for f in b.front_ends)
            click.echo(f"onceq broker listening on {cfg.host}:{b.port} (data "
                       f"{cfg.store.data_dir}, flush {cfg.store.flush}{metrics})", err=True)

        try:
            run(cfg, ready, front_ends)
        except OSError as exc:
            if _data_dir_error(exc, cfg.store.data_dir):
                raise ConfigProblem(f"data_dir: {exc.strerror}: {exc.filename}") from None
            raise click.ClickException(f"cannot start broker: {exc}") from None

    fn: Any = start
    for s in reversed(SETTINGS):
        fn = _option(s)(fn)
    fn = click.option("--print-config", is_flag=True,
                      help="Print the effective settings as TOML (with their sources) and "
                           "exit.")(fn)
    fn = click.option("--config", "-c", type=click.Path(dir_okay=False), default=None,
                      envvar="ONCEQ_CONFIG", help="TOML file of settings (see "
                      "docs/config.md).")(fn)
    return click.command("start")(fn)
