"""Shared CLI plumbing: error reporting with stable exit codes."""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn, TypeVar

import click

from ..client.connection import ConnectionLost, parse_address
from ..client.security import CredentialsError
from ..protocol.errors import OnceqError

T = TypeVar("T")

EXIT_ERROR = 2  # the broker answered with an error
EXIT_UNREACHABLE = 3  # no broker, or the connection broke


def _check_address(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A usage error (exit 2) for an address that is not host:port, not a traceback."""
    try:
        _host, port = parse_address(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if not 1 <= port <= 65535:
        raise click.BadParameter(f"port must be 1..65535, not {port}")
    return value


broker_option = click.option(
    "--broker", "-b", default="127.0.0.1:9876", show_default=True, envvar="ONCEQ_BROKER",
    help="Broker address host:port.", callback=_check_address,
)


class BrokerError(click.ClickException):
    """An error the broker's answers revealed: ``error: ...`` and exit code 2."""

    exit_code = EXIT_ERROR

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def fail(message: str) -> NoReturn:
    raise BrokerError(message)


def exit_for(exc: OnceqError) -> NoReturn:
    """Report a onceq error on one line and exit: 3 when the broker could not be reached
    (or the connection broke), 2 when it answered with an error."""
    if isinstance(exc, ConnectionLost):
        click.echo(f"error: {exc.message}", err=True)
        sys.exit(EXIT_UNREACHABLE)
    click.echo(f"error: {exc.code.name}: {exc.message}", err=True)
    sys.exit(EXIT_ERROR)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine; turn onceq errors into a clear message and a non-zero exit code."""
    try:
        return asyncio.run(coro)
    except OnceqError as exc:
        exit_for(exc)
    except CredentialsError as exc:
        fail(str(exc))


def async_command(fn: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return run_async(fn(*args, **kwargs))

    return wrapper


# integers sent to the broker travel as signed 64 bits: a wider one is a usage error here
WIRE_INT = click.IntRange(-(1 << 63), (1 << 63) - 1)
OFFSET = click.IntRange(0, (1 << 63) - 1)
COUNT = click.IntRange(1, (1 << 63) - 1)
