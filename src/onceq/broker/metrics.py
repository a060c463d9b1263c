"""Prometheus metrics of a broker, served on ``metrics_port`` (off by default).

Cheap on the hot path: a send or pull batch adds to a few plain dict entries
(``on_send``/``on_pull``), and the send and pull handlers are timed into fixed-bucket
histograms. Everything else (lag per group and queue, retries and dead letters, lock
handovers, connections, disk usage) is read from the broker's own state when Prometheus
scrapes. The endpoint is served on the broker's event loop, so a scrape sees consistent
state without locks.

Latencies are the broker's time to handle the request; the wait for fsync (``flush =
"sync"``) and the time a pull is held by long polling are not included.

The metrics port is bounded like the client port (``metrics_http.py``); the limits are
constants here, not settings, and a ``BrokerMetrics`` takes others as ``limits``:

* ``METRICS_MAX_CONNECTIONS`` = 64 connections open at once. At the cap, a new connection
  closes the one open longest that is not being answered (still sending its request head,
  or not reading its answer), so slow or idle connections cannot keep a scrape out; only
  when all 64 are rendering an answer is it refused with ``503`` and closed.
* ``METRICS_HEAD_DEADLINE_S`` = 5 s from accept to the end of the request head: a slow
  sender (a header line now and then, one byte a second) gets ``408`` and is closed.
* ``METRICS_MAX_HEAD_BYTES`` = 8 KiB of request line and headers: beyond it, ``431`` and
  close.
* ``METRICS_WRITE_TIMEOUT_S`` = 10 s to hand the answer to a client that does not read it;
  then the connection is aborted.
* One request per connection (``Connection: close``): no keep-alive holds a slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from ssl import SSLContext
from typing import TYPE_CHECKING, Any

from ..protocol.codes import DLQ_PREFIX, RETRY_PREFIX, RequestCode
from .metrics_http import HttpLimits, MetricsHttpServer
from .tls import metrics_context

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from .broker import Broker

# prometheus_client (about 60 ms to import) is imported only by a broker with metrics on

log = logging.getLogger("onceq.broker.metrics")

MAX_LAG_SERIES = 1000  # per-queue lag series in one scrape (the largest lags)

# seconds: 50 us .. 2.5 s
LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                   0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# limits of the metrics port (see the module docstring)
METRICS_MAX_CONNECTIONS = 64
METRICS_HEAD_DEADLINE_S = 5.0
METRICS_MAX_HEAD_BYTES = 8192
METRICS_WRITE_TIMEOUT_S = 10.0
METRICS_LIMITS = HttpLimits(METRICS_MAX_CONNECTIONS, METRICS_HEAD_DEADLINE_S,
                            METRICS_MAX_HEAD_BYTES, METRICS_WRITE_TIMEOUT_S)


class Histogram:
    """Fixed buckets, plain ints: one ``bisect`` and two additions per observation."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative counts per upper bound, as Prometheus expects them."""
        out, total = [], 0
        for bound, c in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            total += c
            out.append((bound, total))
        return out


def _add(d: dict[str, int], key: str, n: int) -> None:
    d[key] = d.get(key, 0) + n


def _dir_bytes(root: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):  # deleted meanwhile (retention, topic delete)
                total += os.stat(os.path.join(dirpath, f)).st_size
    return total


class BrokerMetrics:
    """The counters of one broker and the collector that exports them."""

    def __init__(self, broker: Broker, limits: HttpLimits = METRICS_LIMITS) -> None:
        self.broker = broker
        self.in_msgs: dict[str, int] = {}  # per topic
        self.in_bytes: dict[str, int] = {}
        self.out_msgs: dict[str, int] = {}
        self.out_bytes: dict[str, int] = {}
        self.dedup_hits: dict[str, int] = {}  # retried sends the dedup window recognised
        self.send_latency = Histogram()
        self.pull_latency = Histogram()
        self.disk_bytes = 0
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.http = MetricsHttpServer(self._answer, limits)
        self.port = 0

    # ---------------------------------------------------------------- hot-path hooks
    def on_send(self, topic: str, count: int, nbytes: int, duplicates: int) -> None:
        """A send batch of ``count`` messages (``duplicates`` of them recognised as retried
        sends, not stored), ``nbytes`` on the wire."""
        if count > duplicates:
            _add(self.in_msgs, topic, count - duplicates)
        _add(self.in_bytes, topic, nbytes)
        if duplicates:
            _add(self.dedup_hits, topic, duplicates)

    def on_pull(self, topic: str, count: int, nbytes: int) -> None:
        """A pull answered with ``count`` messages, ``nbytes`` of them."""
        _add(self.out_msgs, topic, count)
        _add(self.out_bytes, topic, nbytes)

    def time_handlers(self) -> None:
        """Time the send and pull handlers into the latency histograms."""
        handlers = self.broker.handlers
        for code, hist in ((RequestCode.SEND, self.send_latency),
                           (RequestCode.SEND_BATCH, self.send_latency),
                           (RequestCode.SEND_RECORDS, self.send_latency),
                           (RequestCode.SEND_SEQUENCED, self.send_latency),
                           (RequestCode.PULL, self.pull_latency)):
            cls, handler = handlers[code]
            handlers[code] = (cls, _timed(handler, hist))

    # ---------------------------------------------------------------- collector
    def collect(self) -> Iterator[Metric]:
        from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

        b = self.broker
        yield _per_topic("onceq_messages_in", "Messages stored by sends, per topic.",
                         self.in_msgs)
        yield _per_topic("onceq_bytes_in", "Bytes received in sends, per topic.",
                         self.in_bytes)
        yield _per_topic("onceq_messages_out", "Messages delivered by pulls, per topic.",
                         self.out_msgs)
        yield _per_topic("onceq_bytes_out", "Bytes delivered by pulls, per topic.",
                         self.out_bytes)
        yield _per_topic("onceq_dedup_hits",
                         "Retried sends the dedup window answered without storing, per topic.",
                         self.dedup_hits)
        yield _histogram("onceq_send_latency_seconds", "Time to handle a send request.",
                         self.send_latency)
        yield _histogram("onceq_pull_latency_seconds", "Time to handle a pull request.",
                         self.pull_latency)
        yield from self._lag(b)
        yield from self._retries(b)
        yield from b.replies.metrics()  # request-reply
        if b.cluster is not None:
            yield from _cluster(b.cluster.status(), b.cluster.leader_changes)
        if b.sends.fuse is not None:  # the queue-depth fuse (fuse.py)
            c = CounterMetricFamily("onceq_sends_refused_queue_full",
                                    "Sends refused QUEUE_FULL by the queue-depth fuse.")
            c.add_metric([], b.sends.fuse.refused)
            yield c
            g = GaugeMetricFamily("onceq_queue_fuses_tripped",
                                  "Queues whose queue-depth fuse refuses sends now.")
            g.add_metric([], len(b.sends.fuse.tripped))
            yield g
        c = CounterMetricFamily("onceq_access_lock_handovers",
                                "Queues the access lock handed from one member to another.")
        c.add_metric([], b.owners.handovers)
        yield c
        for name, doc, value in (
                ("onceq_schedule_skipped", "Schedule records skipped as undeliverable "
                 "(bad due time or target).", b.retry.skipped if b.retry else 0),
                ("onceq_output_budget_drops", "Clients that did not read, dropped to keep "
                 "the output of all of them within the broker's budget.",
                 b.guard.output_dropped),
                ("onceq_connections_refused", "Connections refused at the connection cap.",
                 b.guard.refused)):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
        c = CounterMetricFamily("onceq_security_events",
                                "Security decisions by event: logins, failed logins, lockouts, "
                                "unauthenticated requests, denials (counted even when the "
                                "audit log leaves a flood's lines out).", labels=["event"])
        for event, count in sorted(b.security.audit.counts.items()):
            c.add_metric([event], count)
        yield c
        g = GaugeMetricFamily("onceq_connections", "Open client connections.")
        g.add_metric([], len(b.connections))
        yield g
        g = GaugeMetricFamily("onceq_group_members", "Live members per consumer group.",
                              labels=["group"])
        for group in sorted(b.groups.groups):
            g.add_metric([group], len(b.groups.members(group)))
        yield g
        g = GaugeMetricFamily("onceq_disk_used_bytes",
                              "Bytes of the broker's data directory (commit log, indexes, "
                              "state).")
        g.add_metric([], self.disk_bytes)
        yield g
        state = b.store.gate.write_state()
        g = GaugeMetricFamily("onceq_disk_used_ratio",
                              "Used share of the data directory's file system.")
        g.add_metric([], state["disk_used"])
        yield g
        g = GaugeMetricFamily("onceq_writes_accepted",
                              "1 while the store accepts writes, 0 while it refuses them.")
        g.add_metric([], 1 if state["accepted"] else 0)
        yield g

    def _lag(self, b: Broker) -> Iterator[Metric]:
        """Messages behind per (group, topic, queue): the queue's max offset minus the
        group's committed offset; and per (group, topic), their sum. Past ``MAX_LAG_SERIES``
        committed queues only the ``MAX_LAG_SERIES`` largest lags get a series of their own
        (a scrape of every one of 100,000s would stall the broker and the scraper);
        ``onceq_consumer_lag_series_left_out`` says how many were left out."""
        from prometheus_client.metrics_core import GaugeMetricFamily

        g = GaugeMetricFamily("onceq_consumer_lag",
                              "Messages not yet consumed (committed) per group and queue "
                              f"(the {MAX_LAG_SERIES} largest when there are more).",
                              labels=["group", "topic", "queue"])
        total = GaugeMetricFamily("onceq_group_lag", "Messages behind per group and topic.",
                                  labels=["group", "topic"])
        store = b.store
        ends: dict[tuple[str, int], int | None] = {}  # a queue's max offset, once per scrape
        rows: list[tuple[int, str, str, int]] = []
        for group, topics in store.offsets.groups.items():
            for topic, queues in topics.items():
                if topic not in store.topics:
                    continue
                sum_lag = 0
                for q, off in queues.items():
                    key = (topic, int(q))
                    hi = ends.get(key, -1)
                    if hi == -1:
                        try:
                            hi = ends[key] = store.min_max(topic, key[1])[1]
                        except Exception:  # a queue beyond a shrunken topic
                            hi = ends[key] = None
                    if hi is None:
                        continue
                    lag = max(0, hi - off) if off >= 0 else 0
                    sum_lag += lag
                    rows.append((lag, group, topic, key[1]))
                total.add_metric([group, topic], sum_lag)
        left_out = max(0, len(rows) - MAX_LAG_SERIES)
        if left_out:
            rows = heapq.nlargest(MAX_LAG_SERIES, rows)
        for lag, group, topic, q in sorted(rows, key=lambda r: r[1:]):
            g.add_metric([group, topic, str(q)], lag)
        yield g
        yield total
        left = GaugeMetricFamily("onceq_consumer_lag_series_left_out",
                                 "Per-queue lag series left out of this scrape (past "
                                 f"{MAX_LAG_SERIES}: only the largest lags are shown).")
        left.add_metric([], left_out)
        yield left

    def _retries(self, b: Broker) -> Iterator[Metric]:
        """Messages that reached each group's retry topic and dead-letter queue (the max
        offsets of those topics, so they survive restarts)."""
        from prometheus_client.metrics_core import CounterMetricFamily

        retry = CounterMetricFamily("onceq_retry_messages",
                                    "Messages redelivered through the group's retry topic.",
                                    labels=["group"])
        dlq = CounterMetricFamily("onceq_dlq_messages",
                                  "Messages moved to the group's dead-letter queue.",
                                  labels=["group"])
        store = b.store
        for name, t in sorted(store.topics.items()):
            for prefix, fam in ((RETRY_PREFIX, retry), (DLQ_PREFIX, dlq)):
                if name.startswith(prefix):
                    fam.add_metric([name[len(prefix):]],
                                   sum(store.min_max(name, q)[1] for q in range(t.queues)))
        yield retry
        yield dlq

    # ---------------------------------------------------------------- endpoint
    async def render(self) -> bytes:
        from prometheus_client.exposition import generate_latest

        loop = asyncio.get_running_loop()
        try:
            self.disk_bytes = await loop.run_in_executor(
                None, _dir_bytes, self.broker.config.store.data_dir)
        except OSError as exc:
            log.warning("metrics: cannot measure the data directory: %s", exc)
        return generate_latest(self.registry)

    async def start(self, host: str, port: int, ssl: SSLContext | None = None) -> None:
        self.port = await self.http.start(host, port, ssl)
        log.info("metrics on %s://%s:%d/metrics", "https" if ssl else "http", host, self.port)

    async def stop(self) -> None:
        await self.http.stop()

    async def _answer(self, method: bytes, path: bytes) -> tuple[str, str, bytes]:
        """Status line, content type and body for one request."""
        if method not in (b"GET", b"HEAD"):
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        if path in (b"/metrics", b"/"):
            from prometheus_client.exposition import CONTENT_TYPE_LATEST

            return "200 OK", CONTENT_TYPE_LATEST, await self.render()
        return "404 Not Found", "text/plain", b"try /metrics\n"


def _timed(handler: Callable[..., Any], hist: Histogram) -> Callable[..., Any]:
    clock = time.perf_counter

    def timed(*args: Any) -> Any:
        t0 = clock()
        try:
            return handler(*args)
        finally:
            hist.observe(clock() - t0)

    return timed


def _per_topic(name: str, doc: str, values: dict[str, int]) -> Metric:
    from prometheus_client.metrics_core import CounterMetricFamily

    c = CounterMetricFamily(name, doc, labels=["topic"])
    for topic, v in sorted(values.items()):
        c.add_metric([topic], v)
    return c


def _histogram(name: str, doc: str, h: Histogram) -> Metric:
    from prometheus_client.metrics_core import HistogramMetricFamily

    m = HistogramMetricFamily(name, doc)
    m.add_metric([], h.buckets(), h.sum)
    return m


async def start_metrics(broker: Broker) -> BrokerMetrics | None:
    """Serve ``/metrics`` when ``metrics_port`` is set (>= 0; 0 picks a free port)."""
    cfg = broker.config
    if cfg.metrics_port < 0:
        return None
    m = BrokerMetrics(broker)
    m.time_handlers()
    await m.start(cfg.metrics_host, cfg.metrics_port, metrics_context(cfg))
    return m


def _cluster(st: dict[str, Any], changes: int) -> Iterator[Metric]:
    """A broker group member's view (docs/cluster.md): leader changes it saw, its role
    and epoch; on the leader, the ISR size, the high watermark and each follower's lag."""
    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

    c = CounterMetricFamily("onceq_leader_changes", "Leaders of its group this broker saw "
                            "elected (terms), itself included.")
    c.add_metric([], changes)
    yield c
    leader = st.get("role") == "leader"
    g = GaugeMetricFamily("onceq_is_leader", "1 while this broker leads its group.")
    g.add_metric([], 1 if leader else 0)
    yield g
    g = GaugeMetricFamily("onceq_high_watermark", "The group's high watermark as this "
                          "broker knows it (a commit-log position).")
    g.add_metric([], float(st.get("hw") or 0))
    yield g
    if not leader:
        return
    g = GaugeMetricFamily("onceq_leader_epoch", "Epoch of the term this broker leads.")
    g.add_metric([], float(st.get("epoch") or 0))
    yield g
    g = GaugeMetricFamily("onceq_isr_size", "In-sync replicas of the group, the leader "
                          "included.")
    g.add_metric([], len(st.get("isr") or []))
    yield g
    g = GaugeMetricFamily("onceq_follower_lag_bytes", "Bytes a follower is behind the "
                          "leader's log end.", labels=["follower"])
    for follower, lag in sorted((st.get("lag") or {}).items()):
        g.add_metric([follower], lag)
    yield g
