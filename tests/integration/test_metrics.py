"""The broker's Prometheus endpoint and the idempotency layer's metrics, scraped while a
producer and a push consumer run: the counters match what was sent and consumed."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from onceq import Admin, Message, Producer
from onceq.client.push import PushConsumer
from onceq.idempotency import MemoryStore, idempotent
from onceq.idempotency import metrics as idem_metrics
from tests.helpers import running_broker

FAST_LEVELS = " ".join(["50ms"] * 18)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """sample name and labels -> value."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def ascrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return await asyncio.to_thread(scrape, url)


def get(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def wait_for(pred: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_scrape_during_a_run(tmp_path):
    n_batches, per_batch, app_resends = 10, 20, 5
    sent = n_batches * per_batch
    async with running_broker(str(tmp_path / "d"), metrics_port=0,
                              delay_levels=FAST_LEVELS) as b:
        url = f"http://127.0.0.1:{b.metrics.port}/metrics"
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("M", 4)
        first = await ascrape(url)
        assert get(first, "onceq_messages_in_total", topic="M") == 0
        assert get(first, "onceq_send_latency_seconds_count") == 0

        keys: list[str] = []
        async with Producer(addr) as p:
            for i in range(n_batches):
                msgs = [Message(f"order-{i}-{j}".encode(), keys=f"o{i}-{j}")
                        for j in range(per_batch)]
                results = await p.send_batch("M", msgs)
                keys += [r.unique_key for r in results]
            # a retried send (same unique key): the dedup window answers, stores nothing
            for r_key in keys[:3]:
                again = await p.send("M", Message(b"x", unique_key=r_key))
                assert again.duplicate
            # an application re-send: new unique key, same business key: stored again
            for j in range(app_resends):
                await p.send("M", Message(f"order-0-{j}".encode(), keys=f"o0-{j}"))
            await p.send("M", Message(b"poison", keys="poison"))
        stored = sent + app_resends + 1

        mid = await ascrape(url)
        assert get(mid, "onceq_messages_in_total", topic="M") == stored
        assert get(mid, "onceq_dedup_hits_total", topic="M") == 3
        assert get(mid, "onceq_bytes_in_total", topic="M") > 0
        assert get(mid, "onceq_send_latency_seconds_count") == n_batches + 3 + app_resends + 1
        assert get(mid, "onceq_send_latency_seconds_bucket", le="+Inf") == \
            get(mid, "onceq_send_latency_seconds_count")

        handled: list[str] = []

        async def handle(msgs, ctx) -> None:
            for m in msgs:
                if m.body == b"poison":
                    raise ValueError("poison")
                handled.append(m.keys)

        registry = CollectorRegistry()
        listener = idem_metrics.track(idempotent(handle, store=MemoryStore(), key="keys"),
                                      name="orders", registry=registry)
        iport = idem_metrics.start_http_server(0, registry=registry)
        iurl = f"http://127.0.0.1:{iport}/metrics"
        c = PushConsumer(addr, "G", listener, consume_from="FIRST", max_reconsume=1,
                         rebalance_interval_s=1.0)
        c.subscribe("M", "*")
        await c.start()
        try:
            async def settled() -> bool:
                s = await ascrape(url)
                return (get(s, "onceq_group_lag", group="G", topic="M") == 0
                        and get(s, "onceq_dlq_messages_total", group="G") == 1
                        and len(handled) == sent)
            await wait_for(settled, 30, "the group to consume everything")
            s = await ascrape(url)
            idem = await ascrape(iurl)
        finally:
            await c.shutdown()
        assert get(s, "onceq_messages_out_total", topic="M") == stored
        assert get(s, "onceq_bytes_out_total", topic="M") >= get(s, "onceq_bytes_in_total",
                                                                 topic="M") - 3 * 200
        for q in range(4):
            assert ("onceq_consumer_lag", (("group", "G"), ("queue", str(q)),
                                           ("topic", "M"))) in s
        assert get(s, "onceq_retry_messages_total", group="G") == 1
        assert get(s, "onceq_pull_latency_seconds_count") > 0
        assert get(s, "onceq_group_members", group="G") == 1
        assert get(s, "onceq_disk_used_bytes") > 0
        assert 0 < get(s, "onceq_disk_used_ratio") <= 1
        assert get(s, "onceq_writes_accepted") == 1
        for protection in ("onceq_schedule_skipped_total", "onceq_output_budget_drops_total",
                           "onceq_connections_refused_total"):
            assert (protection, ()) in s and get(s, protection) == 0  # nothing went wrong

        # the consumer side: every business key claimed once, the re-sends were hits
        assert sorted(handled) == sorted(f"o{i}-{j}" for i in range(n_batches)
                                         for j in range(per_batch))
        # poison: claimed, failed, claimed again on its retry, failed, then the DLQ
        assert get(idem, "onceq_idempotency_claims_total", listener="orders") == sent + 2
        assert get(idem, "onceq_idempotency_hits_total", listener="orders") == app_resends
        assert get(idem, "onceq_idempotency_fenced_total", listener="orders") == 0
        assert get(idem, "onceq_idempotency_store_errors_total", listener="orders") == 0
        assert get(idem, "onceq_idempotency_events_total", listener="orders",
                   event="duplicate") == listener.stats["duplicate"]


async def test_off_by_default_and_a_bad_path(tmp_path):
    async with running_broker(str(tmp_path / "a")) as b:
        assert b.metrics is None
    async with running_broker(str(tmp_path / "b"), metrics_port=0) as b:
        with pytest.raises(urllib.error.HTTPError) as e:
            await asyncio.to_thread(urllib.request.urlopen,
                                    f"http://127.0.0.1:{b.metrics.port}/nope", None, 5)
        assert e.value.code == 404


async def test_metrics_port_in_use_fails_the_start_cleanly(tmp_path):
    async with running_broker(str(tmp_path / "a"), metrics_port=0) as b:
        with pytest.raises(OSError):
            async with running_broker(str(tmp_path / "b"), metrics_port=b.metrics.port):
                pass
    # the store of the broker that failed was closed: it opens again
    async with running_broker(str(tmp_path / "b")):
        pass


async def test_per_queue_lag_series_are_bounded_to_the_largest(tmp_path):
    from onceq.broker.metrics import MAX_LAG_SERIES

    queues = 1000
    async with running_broker(str(tmp_path / "d"), metrics_port=0) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("L", queues)
        async with Producer(addr) as p:
            for q in range(5):  # the only queues behind: one message each
                await p.send("L", b"m", queue=q)
        for group in ("g1", "g2"):
            for q in range(queues):
                b.store.commit_offset(group, "L", q, 0)
        s = await ascrape(f"http://127.0.0.1:{b.metrics.port}/metrics")
    lags = {labels: v for (name, labels), v in s.items() if name == "onceq_consumer_lag"}
    assert len(lags) == MAX_LAG_SERIES < 2 * queues
    assert get(s, "onceq_consumer_lag_series_left_out") == 2 * queues - MAX_LAG_SERIES
    for group in ("g1", "g2"):
        assert get(s, "onceq_group_lag", group=group, topic="L") == 5  # totals are whole
        for q in range(5):  # the largest lags keep their series
            assert get(s, "onceq_consumer_lag", group=group, queue=str(q), topic="L") == 1
