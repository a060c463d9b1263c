"""Prometheus metrics of the idempotency layer, from the consumer process.

``track(listener)`` exports the counters an ``idempotent`` or ``transactional`` listener
keeps (its ``stats``) through prometheus_client's default registry (or the one given), so
that an application that already serves metrics shows them; ``start_http_server(port)``
serves that registry when it does not::

    from onceq.idempotency import idempotent, metrics

    listener = metrics.track(idempotent(handle, store="redis://localhost"), name="orders")
    metrics.start_http_server(9101)

Exported, per tracked listener (label ``listener``):

* ``onceq_idempotency_claims_total``: keys claimed, so the handler ran (a claim taken over
  from an expired owner included);
* ``onceq_idempotency_hits_total``: duplicates acknowledged without running the handler;
* ``onceq_idempotency_fenced_total``: completions refused because the claim had passed to
  another owner meanwhile;
* ``onceq_idempotency_store_errors_total``: failed calls to the dedup store;
* ``onceq_idempotency_events_total{event}``: every counter of ``stats``, by name.

Counters are read when Prometheus scrapes: tracking adds nothing to consumption.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any, TypeVar

import prometheus_client
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, Metric

from .transactional import TransactionalListener

L = TypeVar("L")


def claims(listener: Any, stats: dict[str, int]) -> int:
    """Keys claimed (the handler ran under the claim)."""
    if isinstance(listener, TransactionalListener):  # the claim commits with the effects
        return stats.get("handled", 0) + stats.get("failed", 0)
    return stats.get("claimed", 0) + stats.get("taken_over", 0)


class IdempotencyCollector:
    """Reads the ``stats`` of the tracked listeners at scrape time."""

    def __init__(self) -> None:
        self._tracked: dict[str, weakref.ref[Any]] = {}
        self._lock = threading.Lock()  # track() on the loop, collect() in the HTTP thread

    def track(self, listener: Any, name: str) -> None:
        if not hasattr(listener, "stats"):
            raise TypeError("track() needs an idempotent() or transactional() listener")
        with self._lock:
            self._tracked[name] = weakref.ref(listener)

    def collect(self) -> Iterator[Metric]:
        fams = {
            "claims": CounterMetricFamily(
                "onceq_idempotency_claims", "Keys claimed: the handler ran.",
                labels=["listener"]),
            "hits": CounterMetricFamily(
                "onceq_idempotency_hits",
                "Duplicates acknowledged without running the handler.", labels=["listener"]),
            "fenced": CounterMetricFamily(
                "onceq_idempotency_fenced",
                "Completions refused: the claim had passed to another owner.",
                labels=["listener"]),
            "store_errors": CounterMetricFamily(
                "onceq_idempotency_store_errors", "Failed calls to the dedup store.",
                labels=["listener"]),
        }
        events = CounterMetricFamily("onceq_idempotency_events",
                                     "Every counter of the listener's stats, by name.",
                                     labels=["listener", "event"])
        with self._lock:
            tracked = sorted(self._tracked.items())
        for name, ref in tracked:
            listener = ref()
            if listener is None:
                continue
            stats = dict(listener.stats)
            fams["claims"].add_metric([name], claims(listener, stats))
            fams["hits"].add_metric([name], stats.get("duplicate", 0))
            fams["fenced"].add_metric([name], stats.get("fenced", 0))
            fams["store_errors"].add_metric([name], stats.get("store_errors", 0))
            for event, n in sorted(stats.items()):
                events.add_metric([name, event], n)
        yield from fams.values()
        yield events


_collectors: dict[int, IdempotencyCollector] = {}
_collectors_lock = threading.Lock()


def collector(registry: CollectorRegistry = REGISTRY) -> IdempotencyCollector:
    """The collector registered in ``registry`` (registered on first use)."""
    with _collectors_lock:
        c = _collectors.get(id(registry))
        if c is None:
            c = _collectors[id(registry)] = IdempotencyCollector()
            registry.register(c)
        return c


def track(listener: L, name: str | None = None,
          registry: CollectorRegistry = REGISTRY) -> L:
    """Export ``listener``'s counters under label ``listener=name`` (default: its group,
    else ``default``); returns the listener. Tracking a name again replaces the old one."""
    label = name or getattr(listener, "group", None) or "default"
    collector(registry).track(listener, label)
    return listener


def start_http_server(port: int, addr: str = "127.0.0.1",
                      registry: CollectorRegistry = REGISTRY) -> int:
    """Serve ``registry`` on ``http://addr:port/metrics`` from a daemon thread; returns the
    port (pass 0 for any free port)."""
    server, _thread = prometheus_client.start_http_server(port, addr, registry)
    return int(server.server_port)
