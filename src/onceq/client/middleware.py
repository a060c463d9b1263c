"""Listener middleware: what a push consumer wraps around its listener when it starts.

A middleware has ``wrap(listener) -> listener``. The wrapped listener may also have
``on_consumer_start(consumer)`` (awaited once the consumer is registered, before it
consumes) and ``close()`` (awaited at shutdown); the consumer calls both.

A consumer option may name a middleware by a plain value (``idempotency="sqlite:///d.db"``).
The package that implements it says how to build one from such a value
(:func:`provide`; ``onceq.idempotency`` does for ``idempotency``), so the client depends on
none of them: importing ``onceq`` registers them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from .consume import Listener

__all__ = ["Middleware", "build", "provide"]


class Middleware(Protocol):
    def wrap(self, listener: Listener) -> Listener: ...


_builders: dict[str, Callable[[Any], Middleware]] = {}


def provide(option: str, builder: Callable[[Any], Middleware]) -> None:
    """``builder(value)`` makes the middleware of the consumer option ``option``."""
    _builders[option] = builder


def build(option: str, value: Any) -> Middleware:
    """The middleware the consumer option ``option`` names: ``value`` itself when it is
    one, else what the option's provider builds from it."""
    if callable(getattr(value, "wrap", None)):
        return value
    builder = _builders.get(option)
    if builder is None:
        raise ValueError(f"nothing provides the consumer option {option}=: import "
                         f"onceq.{option}")
    return builder(value)
