"""Every page of the console against a real broker holding real data (through the ASGI
app in-process: no socket, no browser)."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from onceq import Admin, PushConsumer
from onceq.console import ConsoleConfig
from onceq.protocol.codes import retry_topic
from tests.console.world import (
    DEAD,
    GROUP,
    QUEUES,
    SENT,
    TOPIC,
    TRACED,
    console_client,
    text_of,
    token,
)
from tests.helpers import free_port, wait_until


async def test_overview_shows_the_store_disk_rates_and_topics(web, world):
    r = await web.get("/")
    assert r.status_code == 200
    t = text_of(r.text)
    assert f"broker {world.addr}" in t and "loopback only" in t and "no user" in t
    assert "Writes accepted" in t and "writes refused above 100%" in t
    assert "no damaged range" in t and f"{SENT} stored in all" in t
    assert "messages moved to a dead-letter queue 2" in t  # from the metrics endpoint
    assert 'data-live="/live/overview"' in r.text
    live = await web.get("/live/overview")  # a second sample: rates are numbers now
    assert live.status_code == 200 and "/s" in text_of(live.text)
    assert "<html" not in live.text  # a fragment, not a page


async def test_topics_list_and_one_topic_per_queue(web):
    t = text_of((await web.get("/topics")).text)
    assert f"{TOPIC} {QUEUES} {SENT} 0 {SENT}" in t
    assert "%DLQ%" not in t.replace("(%RETRY%, %DLQ%, %TRACE%)", "")
    assert f"%DLQ%{GROUP}" in text_of((await web.get("/topics?system=1")).text)
    t = text_of((await web.get(f"/topics/{TOPIC}")).text)
    for q in range(QUEUES):
        assert f" {q} 0 10 10 " in t
    # a system topic's name goes through the URL encoded
    r = await web.get(f"/topics/%25DLQ%25{GROUP}")
    assert r.status_code == 200 and f"Topic %DLQ%{GROUP}" in text_of(r.text)


async def test_create_then_delete_a_topic_after_confirmation(web, world):
    page = (await web.get("/topics")).text
    r = await web.post("/topics", data={"token": token(page), "name": "fresh", "queues": "3"})
    assert r.status_code == 303
    r = await web.get(r.headers["location"])
    assert "topic fresh: 3 queues" in text_of(r.text)
    # the first post only asks
    r = await web.post("/topics/fresh/delete", data={"token": token(page)})
    assert r.status_code == 200 and "Delete topic fresh?" in text_of(r.text)
    async with Admin(world.addr) as a:
        assert await a.queue_count("fresh") == 3
    r = await web.post("/topics/fresh/delete", data={"token": token(page), "confirm": "yes"})
    assert r.status_code == 303 and "deleted" in r.headers["location"]
    async with Admin(world.addr) as a:
        assert "fresh" not in {t["topic"] for t in await a.list_topics()}


async def test_a_form_without_the_console_token_changes_nothing(web, world):
    r = await web.post("/topics", data={"name": "sneaky", "queues": "1"})
    assert r.status_code == 403 and "stale or was not made by this console" in r.text
    r = await web.post(f"/topics/{TOPIC}/delete", data={"token": "forged", "confirm": "yes"})
    assert r.status_code == 403
    async with Admin(world.addr) as a:
        assert {t["topic"] for t in await a.list_topics()} >= {TOPIC}
        assert "sneaky" not in {t["topic"] for t in await a.list_topics()}


async def test_group_page_members_lag_and_the_chart_fills_while_open(web):
    t = text_of((await web.get("/groups")).text)
    assert f"{GROUP} 0 {TOPIC} 20" in t and f"{TRACED} 0 {TOPIC} 40" in t
    r = await web.get(f"/groups/{GROUP}")
    t = text_of(r.text)
    assert "no live member" in t and "total lag 20" in t and "dead letters: 2" in t
    assert f"{TOPIC} 0 0 10 5 5" in t
    assert "<circle" in r.text  # one sample: a dot
    await asyncio.sleep(0.6)
    frag = (await web.get(f"/groups/{GROUP}/lag")).text
    assert "<polyline" in frag and "2 samples" in frag


async def test_offset_reset_asks_then_moves_and_keeps_the_group_active_rule(web, world):
    page = (await web.get(f"/groups/{GROUP}")).text
    form = {"token": token(page), "topic": TOPIC, "mode": "offset", "value": "2", "queue": ""}
    r = await web.post(f"/groups/{GROUP}/reset", data=form)
    t = text_of(r.text)
    assert r.status_code == 200 and "Reset group billing on orders?" in t
    assert "0 0 10 5 2" in t and "no live member" in t
    async with Admin(world.addr) as a:  # nothing moved yet
        assert await a.group_offset(GROUP, TOPIC, 0) == 5
    r = await web.post(f"/groups/{GROUP}/reset", data={**form, "confirm": "yes"})
    assert r.status_code == 200 and "0 5 2" in text_of(r.text)
    async with Admin(world.addr) as a:
        assert [await a.group_offset(GROUP, TOPIC, q) for q in range(QUEUES)] == [2] * 4
    # by time, one queue: the first message stored at or after epoch 0 is the first
    r = await web.post(f"/groups/{GROUP}/reset", data={
        **form, "mode": "time", "value": "1970-01-01T00:00:00", "queue": "3",
        "confirm": "yes"})
    assert r.status_code == 200 and "3 2 0" in text_of(r.text)

    consumer = PushConsumer(world.addr, GROUP, lambda msgs, ctx: None)
    consumer.subscribe(TOPIC)
    await consumer.start()
    try:
        r = await web.post(f"/groups/{GROUP}/reset", data=form)
        assert "1 live member(s)" in text_of(r.text) and "GROUP_ACTIVE" in r.text
        r = await web.post(f"/groups/{GROUP}/reset", data={**form, "confirm": "yes"})
        assert r.status_code == 409
        assert "GROUP_ACTIVE" in r.text and "tick 'force'" in text_of(r.text)
        r = await web.post(f"/groups/{GROUP}/reset", data={**form, "value": "7",
                                                           "force": "on", "confirm": "yes"})
        assert r.status_code == 200
        async with Admin(world.addr) as a:
            assert await a.group_offset(GROUP, TOPIC, 1) == 7
    finally:
        await consumer.shutdown()


@pytest.mark.parametrize("change, says", [
    ({"value": "abc"}, "offset: 'abc' is not a whole number"),
    ({"value": "-3"}, "offset: -3 is outside"),
    ({"mode": "time", "value": "yesterday"}, "time: 'yesterday' is neither an ISO 8601"),
    ({"queue": "x"}, "queue: 'x' is not a whole number"),
    ({"queue": "9"}, "queue: topic orders has queues 0..3"),
    ({"topic": "nope"}, "TOPIC_NOT_EXIST"),
    ({"mode": "sideways"}, "reset to: 'sideways' is not one of offset, time"),
])
async def test_bad_reset_input_is_a_message_on_the_page(web, change, says):
    page = (await web.get(f"/groups/{GROUP}")).text
    form = {"token": token(page), "topic": TOPIC, "mode": "offset", "value": "1",
            "queue": "", **change}
    r = await web.post(f"/groups/{GROUP}/reset", data=form)
    assert r.status_code in (400, 404)
    assert says in text_of(r.text) and "Traceback" not in r.text


async def test_message_lookup_by_business_key_and_unique_key(web, world):
    key = "order-5"  # queue 1, offset 1: consumed by billing, dead-lettered by billing
    r = await web.get("/messages", params={"topic": TOPIC, "by": "keys", "key": key})
    t = text_of(r.text)
    assert r.status_code == 200 and "1 message(s)" in t and f"{TOPIC}[1]@1" in t
    assert world.keys[key] in t and "billing (consumed)" in t
    assert f"dead letter %DLQ%{GROUP}[0]@1" in t and "bad order 1" in t
    r = await web.get("/messages", params={"topic": TOPIC, "by": "unique",
                                           "key": world.keys["order-6"]})
    t = text_of(r.text)
    assert f"{TOPIC}[2]@1" in t and "no copy in any group's retry or dead-letter topic" in t
    r = await web.get("/messages", params={"topic": TOPIC, "by": "keys", "key": "order-999"})
    assert r.status_code == 200 and "no message of orders with key order-999" in text_of(r.text)


@pytest.mark.parametrize("params, status, says", [
    ({"topic": "nope", "by": "keys", "key": "k"}, 404, "topic 'nope' does not exist"),
    ({"topic": TOPIC, "by": "keys", "key": "k", "begin": "31/12/2026"}, 400,
     "from: '31/12/2026' is neither an ISO 8601"),
    ({"topic": TOPIC, "by": "other", "key": "k"}, 400, "look up by: 'other' is not one of"),
])
async def test_bad_lookup_input(web, params, status, says):
    r = await web.get("/messages", params=params)
    assert r.status_code == status and says in text_of(r.text)


async def test_browse_a_queue_by_offset_range(web, world):
    r = await web.get("/messages/browse", params={"topic": TOPIC, "queue": "2",
                                                  "offset": "3", "count": "4"})
    t = text_of(r.text)
    assert f"{TOPIC}[2]: offsets 3..6 of 0..9" in t
    for off, i in zip(range(3, 7), range(14, 30, 4), strict=True):
        assert f"{off} {world.keys[f'order-{i}']} order-{i} created" in t
    assert "later →" in t and "← earlier" in t


@pytest.mark.parametrize("params, says", [
    ({"topic": TOPIC, "queue": "7"}, "queue: topic orders has queues 0..3"),
    ({"topic": TOPIC, "offset": "99"}, "from offset: 99 is past the end of orders[0]"),
    ({"topic": TOPIC, "offset": "1e3"}, "from offset: '1e3' is not a whole number"),
    ({"topic": TOPIC, "count": "5000"}, "count: 5000 is outside 1..200"),
    ({"topic": "nope"}, "topic 'nope' does not exist"),
])
async def test_bad_browse_input(web, params, says):
    r = await web.get("/messages/browse", params=params)
    assert r.status_code in (400, 404) and says in text_of(r.text)


async def test_dlq_resend_one_after_confirmation_moves_it_to_the_retry_topic(web, world):
    t = text_of((await web.get("/dlq")).text)
    assert f"{GROUP} {DEAD} 0..1" in t
    page = (await web.get(f"/dlq/{GROUP}")).text
    t = text_of(page)
    assert "bad order 0" in t and "bad order 1" in t and f"{TOPIC}[1]@0" in t
    r = await web.post(f"/dlq/{GROUP}/resend", data={"token": token(page), "offset": "1"})
    assert "Resend the dead letter at offset 1 of group billing?" in text_of(r.text)
    async with Admin(world.addr) as a:
        with pytest.raises(Exception, match="TOPIC_NOT_EXIST"):
            await a.queue_offsets(retry_topic(GROUP), 0)
    r = await web.post(f"/dlq/{GROUP}/resend", data={"token": token(page), "offset": "1",
                                                      "confirm": "yes"})
    t = text_of(r.text)
    assert r.status_code == 200 and world.keys["order-5"] in t and f"%RETRY%{GROUP}[0]@0" in t
    async with Admin(world.addr) as a:
        assert await a.queue_offsets(retry_topic(GROUP), 0) == (0, 1)
    r = await web.post(f"/dlq/{GROUP}/resend", data={"token": token(page), "offset": "5"})
    assert r.status_code == 400 and "dead letters are at offsets 0..1" in text_of(r.text)
    r = await web.post(f"/dlq/{GROUP}/resend", data={"token": token(page), "all": "yes"})
    assert f"Resend all {DEAD} dead letter(s) of group billing?" in text_of(r.text)


async def test_duplicates_page_attributes_the_traced_deliveries(web):
    r = await web.get("/duplicates")
    t = text_of(r.text)
    assert f"{TRACED} on" in t and f"{GROUP} off" in t
    # audited: queue 0 (10 messages) delivered twice to one client, nothing between
    assert f"{TRACED} 20 10 10 10 0 0 0 0" in t
    assert "rebalance: 10" in t and "<rect" in r.text
    t = text_of((await web.get("/duplicates", params={"group": GROUP})).text)
    assert "no traced delivery" in t


async def test_trace_can_be_turned_on_from_the_group_page(web, world):
    page = (await web.get(f"/groups/{GROUP}")).text
    r = await web.post(f"/groups/{GROUP}/trace", data={"token": token(page), "state": "on"},
                       follow_redirects=True)
    assert "delivery trace of group billing: on" in text_of(r.text)
    async with Admin(world.addr) as a:
        assert await a.group_trace(GROUP) is True


async def test_read_only_console_shows_no_form_and_refuses_posts(world):
    async with console_client(ConsoleConfig(broker=world.addr, read_only=True)) as web:
        page = (await web.get(f"/groups/{GROUP}")).text
        assert "read-only" in text_of(page) and "Reset offsets" not in page
        assert 'name="token"' not in (await web.get("/topics")).text
        r = await web.post(f"/topics/{TOPIC}/delete", data={"confirm": "yes"})
        assert r.status_code == 403 and "read-only" in text_of(r.text)


async def test_a_broker_that_is_down_is_a_message_on_every_page():
    down = f"127.0.0.1:{free_port()}"
    async with console_client(ConsoleConfig(broker=down)) as web:
        for path in ("/", "/live/overview", "/topics", f"/topics/{TOPIC}", "/groups",
                     f"/groups/{GROUP}", f"/groups/{GROUP}/lag", "/dlq", f"/dlq/{GROUP}",
                     "/duplicates", f"/messages?topic={TOPIC}&key=k",
                     f"/messages/browse?topic={TOPIC}"):
            r = await web.get(path)
            assert r.status_code == 502, path
            assert f"the broker at {down} cannot be reached" in text_of(r.text), path
            assert "Traceback" not in r.text


async def test_a_metrics_endpoint_that_is_down_is_a_message_not_a_failure(world):
    url = f"http://127.0.0.1:{free_port()}/metrics"
    async with console_client(ConsoleConfig(broker=world.addr, metrics_url=url)) as web:
        r = await web.get("/")
        assert r.status_code == 200 and f"cannot read {url}" in text_of(r.text)


async def test_no_page_open_no_connection_to_the_broker(web, world):
    """The console holds no connection and runs no task of its own between requests: with
    no page open it reads nothing from the broker."""
    async def connections() -> float:
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(world.metrics_url, timeout=5).read().decode())
        line = next(x for x in body.splitlines() if x.startswith("onceq_connections "))
        return float(line.split()[1])

    async def none_open() -> bool:
        return await connections() == 0

    await web.get(f"/groups/{GROUP}")
    await web.get("/")
    await wait_until(none_open, 5, "the console's connections to close")
    tasks = len(asyncio.all_tasks())
    await asyncio.sleep(1.0)
    assert await connections() == 0
    assert len(asyncio.all_tasks()) == tasks


async def test_overview_lists_the_brokers_recent_warnings(web, world):
    host, port = world.addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"\xff" * 64)  # not a frame: the broker warns and closes the connection
    await writer.drain()
    assert await reader.read() is not None
    writer.close()
    async with Admin(world.addr) as admin:
        errors = (await admin.broker_status())["recent_errors"]
    assert any(e["level"] == "WARNING" and "closing connection" in e["message"]
               and e["logger"] == "onceq.broker" for e in errors), errors
    t = text_of((await web.get("/")).text)
    assert "Recent errors" in t and "closing connection" in t


async def test_a_lookup_shows_the_dedup_records_of_a_configured_store(world, tmp_path):
    from onceq.idempotency import Claim, open_store

    url = f"sqlite:///{tmp_path / 'dedup.db'}"
    key = world.keys["order-5"]
    store = open_store(url)
    try:
        claim = Claim(GROUP, TOPIC, key, "worker-1")
        [res] = await store.claim_many([claim])
        assert res.runnable
        assert await store.complete_many([claim.ticket], 3600) == [True]
    finally:
        await store.close()
    async with console_client(ConsoleConfig(broker=world.addr, dedup_store=url)) as web:
        t = text_of((await web.get("/messages", params={
            "topic": TOPIC, "by": "unique", "key": key})).text)
        assert f"{GROUP} {key} CONSUMED worker-1" in t
    bad = "nosuch://x"
    async with console_client(ConsoleConfig(broker=world.addr, dedup_store=bad)) as web:
        r = await web.get("/messages", params={"topic": TOPIC, "by": "unique", "key": key})
        assert r.status_code == 400 and "dedup store: unknown dedup store URL scheme" in (
            text_of(r.text))
