"""Shared CLI plumbing: error reporting with stable exit codes."""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import click

from ..client.connection import ConnectionLost
from ..protocol.errors import OnceqError

T = TypeVar("T")

EXIT_ERROR = 2  # the broker answered with an error
EXIT_UNREACHABLE = 3  # no broker, or the connection broke

broker_option = click.option(
    "--broker", "-b", default="127.0.0.1:9876", show_default=True, envvar="ONCEQ_BROKER",
    help="Broker address host:port.",
)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine; turn onceq errors into a clear message and a non-zero exit code."""
    try:
        return asyncio.run(coro)
    except ConnectionLost as exc:
        click.echo(f"error: {exc.message}", err=True)
        sys.exit(EXIT_UNREACHABLE)
    except OnceqError as exc:
        click.echo(f"error: {exc.code.name}: {exc.message}", err=True)
        sys.exit(EXIT_ERROR)


def async_command(fn: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return run_async(fn(*args, **kwargs))

    return wrapper
