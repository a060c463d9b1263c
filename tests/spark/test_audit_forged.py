"""The duplicate audit counts only the broker's trace records: records in ``%TRACE%``
without the broker's mark (forged deliveries, member events, broker starts) change no
verdict, and clients can neither send to the trace topic nor delete it."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from onceq import Admin, ErrorCode, Message, OnceqError, Producer
from onceq.log.record import encode_part
from onceq.protocol.codes import TRACE_TOPIC, PullStatus, RequestCode
from onceq.spark.audit import CAUSES, run_audit
from tests.helpers import running_broker


@pytest.fixture(scope="module")
def broker_box(tmp_path_factory):
    """A broker in a thread; yields {"addr", "broker", "loop"}."""
    ready = threading.Event()
    box: dict = {}

    async def main() -> None:
        async with running_broker(str(tmp_path_factory.mktemp("forged") / "data")) as b:
            box.update(addr=f"127.0.0.1:{b.port}", broker=b, loop=asyncio.get_running_loop(),
                       stop=asyncio.Event())
            ready.set()
            await box["stop"].wait()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield box
    loop.call_soon_threadsafe(box["stop"].set)
    thread.join(10)
    loop.close()


def _forged(now_ms: int, keys: list[str]) -> list[bytes]:
    """Trace records as a client would make them: the properties of the broker's records,
    without its mark (or with another value)."""
    deliver = {"kind": "deliver", "group": "fg-g", "client": "Z", "topic": "fg-t",
               "queue": "0", "handover": "0", "seq": "1"}
    body = json.dumps([{"o": o, "k": k, "r": 0} for o, k in enumerate(keys)]).encode()
    return [
        encode_part(body, "", now_ms, properties=deliver),
        encode_part(body, "", now_ms + 1, properties={**deliver, "src": "client"}),
        encode_part(body, "", now_ms + 2, properties={**deliver, "group": "fg-fake"}),
        encode_part(b"", "", now_ms + 3, properties={
            "kind": "member", "group": "fg-g", "client": "A", "event": "disconnect",
            "seq": "2"}),
        encode_part(b"", "", now_ms + 4, properties={"kind": "broker", "event": "start",
                                                     "seq": "3"}),
        encode_part(body, "", now_ms + 5, properties={**deliver, "client": "Y"}),
    ]


def test_the_audit_ignores_trace_records_the_broker_did_not_write(spark, broker_box):
    addr, b = broker_box["addr"], broker_box["broker"]

    async def scenario() -> list[str]:
        async with Admin(addr) as admin:
            await admin.create_topic("fg-t", 1)
            assert await admin.group_trace("fg-g", True)
            async with Producer(addr) as p:
                keys = [(await p.send("fg-t", Message(b"m%d" % i), queue=0)).unique_key
                        for i in range(2)]
            await admin._request(RequestCode.HEARTBEAT, {"client": "A", "groups": [{
                "group": "fg-g", "subs": {"fg-t": "*"}, "meta": {"access_lock": False}}]})
            h, _ = await admin._request(RequestCode.PULL, {
                "topic": "fg-t", "queue": 0, "offset": 0, "max": 2, "group": "fg-g",
                "client": "A"})
            assert (h["st"], h["n"]) == (PullStatus.FOUND, 2)
            part = _forged(int(time.time() * 1000), keys)[0]
            for req, header in ((RequestCode.SEND, {"topic": TRACE_TOPIC, "queue": 0}),
                                (RequestCode.DELETE_TOPIC, {"topic": TRACE_TOPIC})):
                with pytest.raises(OnceqError) as e:
                    await admin._request(req, header, len(part).to_bytes(4, "little") + part)
                assert e.value.code == ErrorCode.INVALID_ARGUMENT
            return keys

    keys = asyncio.run(scenario())

    async def inject() -> None:  # records in the topic the broker did not write
        for q, rec in enumerate(_forged(int(time.time() * 1000), keys)):
            b.store.put(TRACE_TOPIC, q % b.store.topics[TRACE_TOPIC].queues, [rec],
                        dedup=False)

    asyncio.run_coroutine_threadsafe(inject(), broker_box["loop"]).result(10)
    report = run_audit(spark, addr)
    [g] = report.groups
    assert (g["group"], g["deliveries"], g["unique_keys"], g["duplicates"]) == (
        "fg-g", 2, 2, 0)
    assert g["causes"] == dict.fromkeys(CAUSES, 0)
    assert {r.client for r in report.deliveries.collect()} == {"A"}
