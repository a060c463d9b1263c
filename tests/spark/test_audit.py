"""The duplicate audit: the broker's delivery trace read through the onceq source, each
duplicate attributed to its cause."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner

from onceq import Admin, Message, Producer
from onceq.cli.main import main as cli
from onceq.protocol.codes import PullStatus, RequestCode
from onceq.spark.audit import CAUSES, attribute
from tests.helpers import running_broker


@pytest.fixture(scope="module")
def trace_broker(tmp_path_factory):
    """A broker in a thread: no dedup window (a re-sent unique key is stored again), retry
    delay 50 ms. Yields its address."""
    ready = threading.Event()
    box: dict = {}

    async def main() -> None:
        async with running_broker(str(tmp_path_factory.mktemp("trace") / "data"),
                                  store_kw={"dedup_window_s": 0},
                                  delay_levels="50ms 50ms") as b:
            box["addr"] = f"127.0.0.1:{b.port}"
            box["stop"] = asyncio.Event()
            ready.set()
            await box["stop"].wait()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield box["addr"]
    loop.call_soon_threadsafe(box["stop"].set)
    thread.join(10)
    loop.close()


async def _member(addr: str, group: str, client: str, topic: str) -> Admin:
    a = await Admin(addr).start()
    await a._request(RequestCode.HEARTBEAT, {"client": client, "groups": [{
        "group": group, "subs": {topic: "*"}, "meta": {"access_lock": False}}]})
    return a


async def _pull(a: Admin, group: str, client: str, topic: str, offset: int, n: int) -> int:
    h, _ = await a._request(RequestCode.PULL, {"topic": topic, "queue": 0, "offset": offset,
                                               "max": n, "group": group, "client": client})
    assert h["st"] == PullStatus.FOUND, h
    return h["n"]


def _scenario(addr: str) -> tuple[list[str], float]:
    """Group aud-g on topic aud-t (1 queue), tracing on, traced deliveries:
    A pulls offsets 0..5 (offset 5 re-sends 0's unique key: 1 producer_resend);
    B pulls 3..4 while A is alive (2 rebalance); A's connection drops without unregister,
    C pulls 1..2 (2 crash); offset 2 is sent back and C pulls the retry (1 retry).
    Group aud-x (tracing off) pulls too and must not appear."""
    async def go() -> tuple[list[str], float]:
        async with Admin(addr) as admin:
            await admin.create_topic("aud-t", 1)
            assert await admin.group_trace("aud-g", True)
            async with Producer(addr) as p:
                sent = [await p.send("aud-t", Message(b"m%d" % i), queue=0) for i in range(5)]
                again = await p.send("aud-t", Message(b"m0", unique_key=sent[0].unique_key),
                                     queue=0)
            assert (again.offset, again.duplicate) == (5, False)
            t0 = time.time()
            a = await _member(addr, "aud-g", "A", "aud-t")
            b = await _member(addr, "aud-g", "B", "aud-t")
            assert await _pull(a, "aud-g", "A", "aud-t", 0, 6) == 6
            assert await _pull(b, "aud-g", "B", "aud-t", 3, 2) == 2
            await a.close()  # no unregister: a crash as the broker sees it
            for _ in range(200):  # the broker has seen the connection close
                if "A" not in {m["client"] for m in await admin.group_members("aud-g")}:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the broker did not see A's connection close")
            c = await _member(addr, "aud-g", "C", "aud-t")
            assert await _pull(c, "aud-g", "C", "aud-t", 1, 2) == 2
            await c._request(RequestCode.CONSUMER_SEND_BACK, {
                "group": "aud-g", "topic": "aud-t", "queue": 0, "offset": 2,
                "delay_level": 1})
            for _ in range(100):  # the retry becomes visible after its 50 ms delay
                lo, hi = await admin.queue_offsets("%RETRY%aud-g", 0)
                if hi > lo:
                    break
                await asyncio.sleep(0.05)
            assert await _pull(c, "aud-g", "C", "%RETRY%aud-g", 0, 1) == 1
            x = await Admin(addr).start()
            h, _ = await x._request(RequestCode.PULL, {"topic": "aud-t", "queue": 0,
                                                       "offset": 0, "max": 6,
                                                       "group": "aud-x", "client": "X"})
            assert h["n"] == 6
            for cl in (b, c, x):
                await cl.close()
            return [s.unique_key for s in sent], t0
    return asyncio.run(go())


@pytest.fixture(scope="module")
def scenario(trace_broker):
    return _scenario(trace_broker)


@pytest.mark.slow
def test_audit_attributes_each_cause(spark, trace_broker, scenario, tmp_path):
    """``onceq audit`` (in this process: it runs on the active SparkSession) writes the
    report as JSON, prints the tables and writes each delivery with its cause to Parquet."""
    keys, t0 = scenario
    pq, js = tmp_path / "dups", tmp_path / "audit.json"
    res = CliRunner().invoke(cli, ["audit", "--window", "10 minutes", "--json", str(js),
                                   "--parquet", str(pq), "-b", trace_broker],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "duplicate deliveries by cause" in res.output and "aud-g" in res.output
    doc = json.loads(js.read_text())
    assert doc["causes"] == list(CAUSES)
    assert [g["group"] for g in doc["groups"]] == ["aud-g"]  # aud-x: tracing off
    [g] = doc["groups"]
    assert (g["deliveries"], g["unique_keys"], g["duplicates"]) == (11, 5, 6)
    assert g["causes"] == {"rebalance": 2, "crash": 2, "broker_restart": 0, "retry": 1,
                           "producer_resend": 1}
    rows = {(r.client, r.topic, r.offset): r for r in spark.read.parquet(str(pq)).collect()}
    assert len(rows) == 11
    assert (rows[("B", "aud-t", 3)].cause, rows[("B", "aud-t", 3)].prev_client) == (
        "rebalance", "A")
    assert (rows[("C", "aud-t", 1)].cause, rows[("C", "aud-t", 1)].prev_client) == (
        "crash", "A")
    assert rows[("C", "%RETRY%aud-g", 0)].cause == "retry"
    assert rows[("C", "%RETRY%aud-g", 0)].reconsume == 1
    assert rows[("A", "aud-t", 5)].cause == "producer_resend"
    assert rows[("A", "aud-t", 0)].cause is None and not rows[("A", "aud-t", 0)].duplicate
    assert rows[("A", "aud-t", 0)].unique_key == keys[0]
    assert abs(rows[("A", "aud-t", 0)].ts.timestamp() - t0) < 5
    win = [w for w in doc["windows"] if w["topic"] == "aud-t"]
    assert sum(w["duplicates"] for w in win) == 5  # the retry is on the retry topic
    assert sum(w["causes"]["crash"] for w in win) == 2


def test_audit_cli_without_trace_topic():
    res = CliRunner().invoke(cli, ["audit", "-b", "127.0.0.1:1"])
    assert res.exit_code == 1 and "cannot read the trace topic" in res.output


def _trace_rows(spark, rows):
    """A trace DataFrame from (kind, group, client, offset, event, key, reconsume, sec),
    in the order the broker stored them (``seq``)."""
    base = datetime(2026, 1, 1, tzinfo=UTC)
    data = [(k, g, c, "t", 0, i + 1, o, False, e, key, r, base + timedelta(seconds=s))
            for i, (k, g, c, o, e, key, r, s) in enumerate(rows)]
    return spark.createDataFrame(data, "kind string, group string, client string, "
                                       "topic string, queue int, seq long, offset long, "
                                       "handover boolean, event string, unique_key string, "
                                       "reconsume int, ts timestamp")


def test_attribution_orders_events_within_one_millisecond(spark):
    """Records stored in the same millisecond keep the broker's order: a member that
    disconnected just after another took its queue does not make that a crash."""
    trace = _trace_rows(spark, [
        ("deliver", "g", "A", 0, None, "k0", 0, 1),
        ("deliver", "g", "B", 0, None, "k0", 0, 1),  # before A's disconnect: rebalance
        ("member", "g", "A", None, "disconnect", "", 0, 1),
        ("deliver", "g", "C", 0, None, "k0", 0, 1),  # B still there: rebalance
        ("member", "g", "C", None, "disconnect", "", 0, 1),
        ("deliver", "g", "D", 0, None, "k0", 0, 1),  # C left in between: crash
    ])
    got = [(r.client, r.cause) for r in attribute(trace).orderBy("seq").collect()]
    assert got == [("A", None), ("B", "rebalance"), ("C", "rebalance"), ("D", "crash")]


def test_attribution_broker_restart_and_expired_member(spark):
    trace = _trace_rows(spark, [
        ("deliver", "g", "A", 0, None, "k0", 0, 1),
        ("deliver", "g", "A", 1, None, "k1", 0, 1),
        ("broker", None, None, None, "start", "", 0, 2),
        ("deliver", "g", "A", 1, None, "k1", 0, 3),  # after the restart: broker_restart
        ("member", "g", "A", None, "expired", "", 0, 4),
        ("deliver", "g", "B", 1, None, "k1", 0, 5),  # A expired meanwhile: crash
        ("deliver", "g", "A", 0, None, "k0", 0, 6),  # the restart was in between
        ("member", "g", "B", None, "leave", "", 0, 7),
        ("deliver", "g", "C", 1, None, "k1", 0, 8),  # B left gracefully: rebalance
    ])
    got = sorted((r.client, r.offset, r.ts.second if r.ts else 0, r.cause)
                 for r in attribute(trace).collect())
    assert [g[3] for g in got] == [None, "broker_restart", None, "broker_restart", "crash",
                                   "rebalance"], got
    assert set(CAUSES) >= {g[3] for g in got if g[3]}
