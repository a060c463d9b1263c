"""``onceq --log-level LEVEL --log-format text|json COMMAND``: logging for every command."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
from click.core import ParameterSource

from ..broker.settings import LOG_FORMATS, LOG_LEVELS
from ..logconfig import setup_logging

CLI_DEFAULT_LEVEL = "WARNING"  # client commands stay quiet; ``broker start`` logs INFO


def log_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("--log-format", type=click.Choice(LOG_FORMATS), default=None,
                      envvar="ONCEQ_LOG_FORMAT",
                      help="text, or json: one JSON object per line on stderr.")(fn)
    return click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False),
                        default=None, envvar="ONCEQ_LOG_LEVEL",
                        help=f"Log level (default {CLI_DEFAULT_LEVEL}; the broker: INFO, or "
                             "its log_level setting).")(fn)


def setup_cli_logging(log: dict[str, str | None]) -> None:
    """Set up logging for the command; keep the levels given on the command line for
    ``broker start``, where they count as its flags."""
    ctx = click.get_current_context()
    explicit = {k: v.upper() if k == "log_level" else v for k, v in log.items()
                if v is not None and ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
    obj = ctx.ensure_object(dict)
    obj["log"] = explicit
    obj["log_format"] = log["log_format"] or "text"
    setup_logging((log["log_level"] or CLI_DEFAULT_LEVEL).upper(), obj["log_format"])


def command_log_level(level: str) -> None:
    """A command's own ``--log-level`` (``consume``): used when given, else the one given to
    ``onceq`` itself, else the command's default; the format stays the one chosen for
    ``onceq``."""
    ctx = click.get_current_context()
    root = ctx.find_root().obj or {}
    if ctx.get_parameter_source("log_level") != ParameterSource.COMMANDLINE:
        level = root.get("log", {}).get("log_level", level)
    setup_logging(level.upper(), root.get("log_format", "text"))
