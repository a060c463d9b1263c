"""FIFO message groups, retries and dead letters with the official RocketMQ 5 Python client
(in processes of its own, ``rmq_proc.py``) against an onceq broker: FIFO producers place a
message group where onceq's ``sharding_key`` would; consumers of a FIFO group
(``rocketmq_groups.json``) get each group's messages in order, also across a redelivery;
a message never acknowledged goes to ``%DLQ%<group>`` after the group's maximum of
delivery attempts; ``ForwardMessageToDeadLetterQueue`` moves a message there at once."""

from __future__ import annotations

import asyncio
import signal
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onceq.protocol.codes import dlq_topic
from tests.helpers import free_port, spawn_broker, wait_port

from .conftest import RmqBroker, make_topic, need_client, read_all, rmq_broker

GROUPS: dict[str, dict[str, object]] = {
    "fifo-simple-g": {"fifo": True},
    "fifo-push-g": {"fifo": True, "max_delivery_attempts": 3, "retry_delays": "1s"},
    "dlq-g": {"max_delivery_attempts": 3},
    "fwd-g": {},
}
MESSAGE_GROUPS = ["alpha", "beta", "gamma", "delta"]


@pytest.fixture(scope="module")
def rmq(tmp_path_factory: Any) -> Iterator[RmqBroker]:
    pytest.importorskip("google.protobuf")
    from onceq.rocketmq.groups import save

    root = tmp_path_factory.mktemp("rmq-fifo")
    (root / "data").mkdir()
    save(str(root / "data"), GROUPS)
    with rmq_broker(root) as b:
        yield b




def _fifo_messages(prefix: str, per_group: int) -> list[dict[str, Any]]:
    """Messages of the message groups interleaved: ``<group>-<i>``."""
    return [{"body": f"{prefix}{g}-{i}", "group": g} for i in range(per_group)
            for g in MESSAGE_GROUPS]


def _by_group(bodies: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for b in bodies:
        out.setdefault(b.rsplit("-", 1)[0], []).append(b)
    return out


def test_fifo_producer_places_each_message_group_as_onceqs_sharding_key(rmq: RmqBroker):
    asyncio.run(make_topic(rmq.addr, "fifo-place"))
    sent = _fifo_messages("", 4)
    rmq.client("produce", topic="fifo-place", messages=sent)
    stored = asyncio.run(read_all(rmq.addr, "fifo-place"))
    assert len(stored) == len(sent)
    for m in stored:
        group = m.properties["__SHARDINGKEY"]
        assert m.queue_id == zlib.crc32(group.encode()) % 4  # Producer's sharding_key
    for g in MESSAGE_GROUPS:  # in each queue in the order sent
        mine = sorted((m for m in stored if m.properties["__SHARDINGKEY"] == g),
                      key=lambda m: m.queue_offset)
        assert [m.body.decode() for m in mine] == [f"{g}-{i}" for i in range(4)]


def test_fifo_simple_consumer_gets_each_group_in_order_also_across_a_redelivery(
        rmq: RmqBroker):
    asyncio.run(make_topic(rmq.addr, "fifo-simple"))
    sent = _fifo_messages("s", 5)
    rmq.client("produce", topic="fifo-simple", messages=sent)
    # two at a time: the next receive comes while a message left is still out
    out = rmq.client("fifo_simple", topic="fifo-simple", group="fifo-simple-g", batch=2,
                     n=len(sent), leave=["salpha-1", "sgamma-3"], invisible=2, timeout=40)
    assert out["violations"] == []  # nothing of a group while an earlier one was out
    want = _by_group([m["body"] for m in sent])
    assert _by_group(out["acked"]) == want  # each group in the order sent, each once
    deliveries = out["deliveries"]
    assert all(d[2] == d[0][1:].rsplit("-", 1)[0] for d in deliveries)  # message group
    # the one left came back (attempt 2) before anything after it in its group
    order = [(b, a) for b, a, _g in deliveries]
    again = order.index(("salpha-1", 2))
    later = [i for i, (b, _a) in enumerate(order) if b in ("salpha-2", "salpha-3")]
    assert all(i > again or (order[i][1] == 1 and i < again) for i in later)
    acked = out["acked"]
    assert acked.index("salpha-1") < acked.index("salpha-2") < acked.index("salpha-3")
    assert ("sgamma-3", 2) in order
    # the same consumer in a group that is not FIFO: the messages after the one left are
    # handed out while it is out (the contrast)
    plain = rmq.client("fifo_simple", topic="fifo-simple", group="not-fifo-g", batch=2,
                       n=len(sent), leave=["salpha-1"], invisible=2, timeout=40)
    assert "salpha-2" in plain["violations"]


def test_fifo_push_consumer_keeps_order_and_forwards_a_failing_message_to_the_dlq(
        rmq: RmqBroker):
    asyncio.run(make_topic(rmq.addr, "fifo-push"))
    sent = _fifo_messages("p", 5)
    rmq.client("produce", topic="fifo-push", messages=sent)
    out = rmq.client("fifo_push", topic="fifo-push", group="fifo-push-g", n=len(sent) - 1,
                     fail=["pbeta-1"], fail_once=["pgamma-3"], linger=1, timeout=40)
    assert out["fifo"] is True  # the broker's settings made it a FIFO consumer
    log = out["log"]
    ok = [b for b, _g, _a, r in log if r == "ok"]
    want = _by_group([m["body"] for m in sent if m["body"] != "pbeta-1"])
    assert _by_group(ok) == want  # in order, each once
    # pbeta-1: its 3 local attempts, then to the DLQ; pbeta-2 only after them
    calls = [i for i, e in enumerate(log) if e[0] == "pbeta-1"]
    assert len(calls) == 3 and all(log[i][3] == "fail" for i in calls)
    assert min(i for i, e in enumerate(log) if e[0] == "pbeta-2") > max(calls)
    gamma = [e[3] for e in log if e[0] == "pgamma-3"]
    assert gamma == ["fail", "ok"]
    assert (next(i for i, e in enumerate(log) if e[0] == "pgamma-4")
            > [i for i, e in enumerate(log) if e[0] == "pgamma-3"][-1])
    dead = asyncio.run(read_all(rmq.addr, dlq_topic("fifo-push-g"), 1))
    assert [m.body.decode() for m in dead] == ["pbeta-1"]
    assert "forwarded to the dead-letter queue" in dead[0].properties["DLQ_REASON"]
    assert dead[0].properties["ORIGIN_TOPIC"] == "fifo-push"


def test_a_message_never_acknowledged_goes_to_the_dlq_after_max_attempts(rmq: RmqBroker):
    asyncio.run(make_topic(rmq.addr, "dlq-topic", 2))
    rmq.client("produce", topic="dlq-topic", messages=[{"body": "d-0"}, {"body": "d-1"}])
    out = rmq.client("never_ack", topic="dlq-topic", group="dlq-g", invisible=1, idle=3,
                     timeout=25)
    got: dict[str, list[int]] = {}
    for body, attempt in out["deliveries"]:
        got.setdefault(body, []).append(attempt)
    assert got == {"d-0": [1, 2, 3], "d-1": [1, 2, 3]}  # then not delivered again
    dead = asyncio.run(read_all(rmq.addr, dlq_topic("dlq-g"), 1))
    assert sorted(m.body.decode() for m in dead) == ["d-0", "d-1"]
    assert all("not acknowledged after 3 deliveries" in m.properties["DLQ_REASON"]
               for m in dead)
    again = rmq.client("never_ack", topic="dlq-topic", group="dlq-g", idle=1.5, timeout=10)
    assert again["deliveries"] == []  # they count as acknowledged


def test_forward_message_to_dead_letter_queue(rmq: RmqBroker):
    asyncio.run(make_topic(rmq.addr, "fwd-topic", 2))
    rmq.client("produce", topic="fwd-topic",
               messages=[{"body": f"f-{i}"} for i in range(3)])
    out = rmq.client("forward", topic="fwd-topic", group="fwd-g", n=3, dlq=["f-1"])
    assert out["received"] == ["f-0", "f-1", "f-2"]
    # forwarded once; the same handle again is stale (the message is not in flight)
    assert out["answers"] == {"f-1": [20000, 40013]}
    assert out["extra"] == []  # acknowledged by the forward
    dead = asyncio.run(read_all(rmq.addr, dlq_topic("fwd-g"), 1))
    assert [m.body.decode() for m in dead] == ["f-1"]


def test_delivery_attempts_carry_on_across_a_broker_sigkill(tmp_path: Path):
    """Delivered twice, the broker killed and started again: the third delivery is the
    last, then the message is in the dead-letter queue (the journal kept the count)."""
    need_client()
    from onceq.rocketmq.groups import save

    (tmp_path / "data").mkdir()
    save(str(tmp_path / "data"), {"dlq-g": {"max_delivery_attempts": 3}})
    port, gport = free_port(), free_port()
    proc, addr = spawn_broker(str(tmp_path / "data"), "--grpc-port", str(gport), port=port)
    try:
        wait_port(gport, 15)
        b = RmqBroker(addr, f"127.0.0.1:{gport}", tmp_path)
        asyncio.run(make_topic(addr, "dlq-restart", 1))
        b.client("produce", topic="dlq-restart", messages=[{"body": "r-0"}])
        before = b.client("never_ack", topic="dlq-restart", group="dlq-g", invisible=1,
                          until_attempt=2, timeout=15)
        assert before["deliveries"] == [["r-0", 1], ["r-0", 2]]
        proc.send_signal(signal.SIGKILL)
        proc.wait(15)
        proc, _ = spawn_broker(str(tmp_path / "data"), "--grpc-port", str(gport), port=port)
        wait_port(gport, 15)
        after = b.client("never_ack", topic="dlq-restart", group="dlq-g", invisible=1,
                         idle=3, timeout=20)
        assert after["deliveries"] == [["r-0", 3]]
        dead = asyncio.run(read_all(addr, dlq_topic("dlq-g"), 1))
        assert [m.body.decode() for m in dead] == ["r-0"]
    finally:
        proc.terminate()
        proc.wait(15)
