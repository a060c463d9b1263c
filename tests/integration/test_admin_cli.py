"""Admin commands (``topic status``, ``group status``, ``message show``, ``group trace``,
``group reset-offsets``, ``dlq list|resend``) as subprocesses against a child broker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from onceq import Admin, Message, SyncProducer
from onceq.idempotency import open_store
from onceq.idempotency.record import Claim
from onceq.protocol.codes import RequestCode
from tests.helpers import admin, module_broker
from tests.integration.test_cli import ok, run, run_many, table_rows


@pytest.fixture(scope="module")
def baddr(tmp_path_factory) -> Iterator[str]:
    yield from module_broker(tmp_path_factory, "adm")


def failed(r, code: str) -> str:
    assert r.returncode == 2, (r.args, r.stdout, r.stderr)
    assert r.stderr.startswith(f"error: {code}:"), r.stderr
    return r.stderr


@pytest.fixture(scope="module")
def orders(baddr):
    """Topic adm-orders (2 queues, 6 messages with business keys); group adm-g has
    committed offset 2 on queue 0, adm-h offset 0 there."""
    admin(baddr, lambda a: a.create_topic("adm-orders", 2))
    with SyncProducer(baddr) as p:
        sent = [p.send("adm-orders", Message(f"order {i}".encode(), keys=f"order-{i} shop-1"),
                       queue=i % 2) for i in range(6)]
    admin(baddr, lambda a: a.reset_offsets("adm-g", "adm-orders", to_offset=2, queue=0))
    admin(baddr, lambda a: a.reset_offsets("adm-h", "adm-orders", to_offset=0, queue=0))
    return sent


def test_topic_status_table_json_and_unknown(baddr, orders):
    table, as_json, unknown = run_many([
        ("topic", "status", "adm-orders", "-b", baddr),
        ("topic", "status", "adm-orders", "--json", "-b", baddr),
        ("topic", "status", "adm-nope", "-b", baddr)])
    rows = table_rows(ok(table))
    assert [r[:4] for r in rows] == [["0", "0", "3", "3"], ["1", "0", "3", "3"]]
    doc = json.loads(ok(as_json))
    assert [(q["queue"], q["min"], q["max"]) for q in doc["queues"]] == [(0, 0, 3), (1, 0, 3)]
    assert all(q["last_store_ms"] >= q["first_store_ms"] > 0 for q in doc["queues"])
    assert "6 message(s) in 2 queue(s)" in table.stdout
    assert "topic 'adm-nope'" in failed(unknown, "TOPIC_NOT_EXIST")


def test_message_show_by_unique_key_and_business_key(baddr, orders):
    m1, m4 = orders[1], orders[4]  # queue 1 offset 0; queue 0 offset 2
    by_uk, by_key, shop = run_many([
        ("message", "show", "-t", "adm-orders", "--unique-key", m4.unique_key, "--json",
         "-b", baddr),
        ("message", "show", "-t", "adm-orders", "--key", "order-1", "-b", baddr),
        ("message", "show", "-t", "adm-orders", "--key", "shop-1", "--json", "-b", baddr)])
    doc = json.loads(ok(by_uk))
    [m] = doc["messages"]
    assert (m["queue"], m["offset"], m["unique_key"], m["keys"]) == (
        0, 2, m4.unique_key, "order-4 shop-1")
    assert m["store_ms"] >= m["born_ms"] > 0 and m["store_time"].endswith("+00:00")
    # adm-g committed 2 on queue 0: offset 2 is its next message, not consumed yet
    assert {(g["group"], g["consumed"]) for g in m["consumed_by"]} == {
        ("adm-g", False), ("adm-h", False)}
    rows = table_rows(ok(by_key))
    assert rows[0][:3] == ["1", "0", m1.unique_key]
    assert len(json.loads(ok(shop))["messages"]) == 6


def test_message_show_consumed_by(baddr, orders):
    doc = json.loads(ok(run("message", "show", "-t", "adm-orders", "-i", orders[2].unique_key,
                            "--json", "-b", baddr)))
    [m] = doc["messages"]
    assert (m["queue"], m["offset"]) == (0, 1)
    assert {(g["group"], g["committed"], g["consumed"]) for g in m["consumed_by"]} == {
        ("adm-g", 2, True), ("adm-h", 0, False)}


def test_message_show_errors(baddr, orders):
    no_key, no_topic, both, bad_time = run_many([
        ("message", "show", "-t", "adm-orders", "--key", "order-99", "-b", baddr),
        ("message", "show", "-t", "adm-nope", "--key", "order-1", "-b", baddr),
        ("message", "show", "-t", "adm-orders", "--key", "a", "-i", "b", "-b", baddr),
        ("message", "show", "-t", "adm-orders", "--key", "a", "--begin", "yesterday",
         "-b", baddr)])
    err = failed(no_key, "MESSAGE_NOT_FOUND")
    assert "business key 'order-99'" in err and "6 record(s) scanned" in err
    failed(no_topic, "TOPIC_NOT_EXIST")
    assert both.returncode == 2 and "exactly one of --unique-key and --key" in both.stderr
    assert bad_time.returncode == 2 and "neither epoch milliseconds nor ISO" in bad_time.stderr
    # a unique key whose embedded time is far from when it was stored: outside its range
    far = orders[0].unique_key[:20] + "000000000001" + orders[0].unique_key[32:]
    failed(run("message", "show", "-t", "adm-orders", "-i", far, "-b", baddr),
           "MESSAGE_NOT_FOUND")


def test_message_scan_limit_is_reported(baddr, orders):
    async def go(a: Admin):
        return await a.query_message("adm-orders", "order-5", by="keys", max_scan=2)
    with pytest.raises(Exception) as exc:
        admin(baddr, go)
    assert "MESSAGE_NOT_FOUND" in str(exc.value) and "stopped after 2 records" in str(exc.value)

    async def bad(a: Admin):
        return await a._request(RequestCode.QUERY_MESSAGE,
                                {"topic": "adm-orders", "key": "x", "by": "body"})
    with pytest.raises(Exception, match="INVALID_ARGUMENT"):
        admin(baddr, bad)


def test_message_search_stops_at_max_results(baddr):
    admin(baddr, lambda a: a.create_topic("adm-same", 1))
    with SyncProducer(baddr) as p:
        for i in range(5):
            p.send("adm-same", Message(f"v{i}".encode(), keys="same-key"), queue=0)

    async def go(a: Admin):
        return await a.query_message("adm-same", "same-key", by="keys", max_results=2)
    doc = admin(baddr, go)
    assert [m["offset"] for m in doc["messages"]] == [0, 1]


def test_message_show_dedup_record(baddr, orders, tmp_path):
    url = f"sqlite:///{tmp_path / 'dedup.db'}"
    key = orders[2].unique_key

    async def claim():
        store = open_store(url)
        try:
            claim = Claim("adm-g", "adm-orders", key, "worker-1")
            [res] = await store.claim_many([claim])
            assert res.runnable
            assert await store.complete_many([claim.ticket], 3600) == [True]
        finally:
            await store.close()
    asyncio.run(claim())
    doc = json.loads(ok(run("message", "show", "-t", "adm-orders", "-i", key,
                            "--dedup-store", url, "--json", "-b", baddr)))
    [rec] = doc["messages"][0]["dedup"]
    assert (rec["group"], rec["key"], rec["status"], rec["owner"]) == (
        "adm-g", key, "CONSUMED", "worker-1")
    out = ok(run("message", "show", "-t", "adm-orders", "-i", key, "--dedup-store", url,
                 "-b", baddr))
    assert "dedup records" in out and "CONSUMED" in out


def test_group_status_json_and_unknown(baddr, orders):
    as_json, unknown = run_many([("group", "status", "adm-g", "--json", "-b", baddr),
                                 ("group", "status", "adm-nope", "-b", baddr)])
    doc = json.loads(ok(as_json))
    assert doc["members"] == []
    q0 = next(q for q in doc["queues"] if q["topic"] == "adm-orders" and q["queue_id"] == 0)
    assert (q0["committed"], q0["max_offset"], q0["lag"], q0["lock_holder"],
            q0["orderly_holder"]) == (2, 3, 1, None, None)
    failed(unknown, "GROUP_NOT_EXIST")


def test_group_reset_offsets_alias(baddr, orders):
    doc = json.loads(ok(run("group", "reset-offsets", "-g", "adm-r", "-t", "adm-orders",
                            "--to-offset", "1", "--json", "-b", baddr)))
    assert [(q["queue"], q["new"]) for q in doc["queues"]] == [(0, 1), (1, 1)]
    doc = json.loads(ok(run("group", "reset-offsets", "-g", "adm-r", "-t", "adm-orders",
                            "--to-time", "2000-01-01T00:00:00Z", "--json", "-b", baddr)))
    assert [(q["queue"], q["old"], q["new"]) for q in doc["queues"]] == [(0, 1, 0), (1, 1, 0)]


def test_group_trace_switch(baddr):
    on = run("group", "trace", "adm-t", "on", "-b", baddr)
    assert ok(on).strip() == "delivery trace of group adm-t: on"
    shown, other = run_many([("group", "trace", "adm-t", "-b", baddr),
                             ("group", "trace", "adm-u", "-b", baddr)])
    assert ok(shown).strip().endswith(": on") and ok(other).strip().endswith(": off")
    assert ok(run("group", "trace", "adm-t", "off", "-b", baddr)).strip().endswith(": off")
    bad = run("group", "trace", "bad name!", "on", "-b", baddr)
    failed(bad, "INVALID_NAME")
    assert run("group", "trace", "adm-t", "maybe", "-b", baddr).returncode == 2


def test_dlq_list_and_resend_json(baddr):
    admin(baddr, lambda a: a.create_topic("adm-dl", 1))
    with SyncProducer(baddr) as p:
        sent = [p.send("adm-dl", Message(f"bad {i}".encode()), queue=0) for i in range(2)]

    async def to_dlq(a: Admin):
        for group in ("adm-d", "adm-g"):  # the broker knows the groups
            await a.reset_offsets(group, "adm-dl", to_offset=0)
        for m in sent:  # failed for good: max_reconsume 0 goes to the dead-letter queue
            await a._request(RequestCode.CONSUMER_SEND_BACK, {
                "group": "adm-d", "topic": "adm-dl", "queue": 0, "offset": m.offset,
                "max_reconsume": 0})
    admin(baddr, to_dlq)
    listed, empty = run_many([("dlq", "list", "adm-d", "--json", "-b", baddr),
                              ("dlq", "list", "adm-g", "--json", "-b", baddr)])
    doc = json.loads(ok(listed))
    assert [(x["offset"], x["unique_key"], x["origin_topic"], x["body"])
            for x in doc["letters"]] == [(i, m.unique_key, "adm-dl", f"bad {i}")
                                         for i, m in enumerate(sent)]
    assert json.loads(ok(empty))["letters"] == []
    # no member ever registered: the group's retry topic is created by the resend
    doc = json.loads(ok(run("dlq", "resend", "adm-d", "--offset", "1", "--json",
                            "-b", baddr)))
    [r] = doc["resent"]
    assert (r["dlq_offset"], r["unique_key"], r["topic"], r["error"]) == (
        1, sent[1].unique_key, "%RETRY%adm-d", None)
    failed(run("dlq", "resend", "adm-d", "--offset", "7", "-b", baddr), "INVALID_ARGUMENT")
    failed(run("dlq", "list", "adm-nope", "-b", baddr), "GROUP_NOT_EXIST")
