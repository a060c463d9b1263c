"""Request-reply over the bus (docs/request_reply.md): round trips, timeouts with their
stable code, late replies dropped and counted at the broker and at the client, replies to
a requester that is gone, responders joining, leaving and one SIGKILLed mid-request with
the idempotency layer (every request answered, its effect once, the same reply on retry),
the sync API, the CLI and the broker's metrics."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from onceq import Admin, ErrorCode, Message, OnceqError, Producer, PushConsumer, SyncProducer
from onceq.cli.main import main as cli
from onceq.client.request_reply import RequestTimeout, request_properties
from onceq.client.responder import responder
from onceq.idempotency import idempotent
from tests.helpers import running_broker, wait_until

CHILD = Path(__file__).resolve().parents[1] / "responder_proc.py"


async def echo(m):
    return b"re:" + m.body


async def start_responder(addr: str, listener, group: str = "rr", topic: str = "rpc",
                          **kw) -> PushConsumer:
    c = PushConsumer(addr, group, listener, consume_from="FIRST", rebalance_interval_s=1.0,
                     **kw)
    c.subscribe(topic)
    return await c.start()


@pytest.fixture
async def rpc(tmp_path):
    """A broker with metrics on and a topic ``rpc`` of 4 queues; its address. Its retry
    delays are all 250 ms: a request found busy under a dead responder's lease (1 s in
    ``responder_proc.py``) comes back a few times until the lease lapses, far from the
    DLQ after 16."""
    async with running_broker(str(tmp_path / "data"), metrics_port=0,
                              delay_levels=" ".join(["250ms"] * 18)) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("rpc", 4)
        yield b, addr


async def test_round_trip_async_sync_and_metrics(rpc):
    broker, addr = rpc
    c = await start_responder(addr, responder(echo))
    try:
        async with Producer(addr) as p:
            replies = await asyncio.gather(*(p.request("rpc", f"q{i}", timeout=10)
                                             for i in range(20)))
            assert [r.body for r in replies] == [f"re:q{i}".encode() for i in range(20)]
            assert len({r.request_id for r in replies}) == 20
            r = await p.request("rpc", Message(b"m", tags="T", properties={"a": "1"}),
                                timeout=10)
            assert r.body == b"re:m" and r.topic == "rpc" and r.elapsed_s > 0
            stats = p.requests.stats
            assert (stats["requests"], stats["replies"], stats["waiting"]) == (21, 21, 0)
            assert 0 < stats["p50_s"] <= stats["p99_s"]

        def sync_round_trip() -> bytes:
            with SyncProducer(addr) as sp:
                return sp.request("rpc", b"sync", timeout=10).body

        assert await asyncio.to_thread(sync_round_trip) == b"re:sync"
        # the responder counts a reply when the broker's answer to it comes back, which
        # may be after the requester got the reply
        await wait_until(lambda: c.stats["replies_sent"] == 22, 10, "replies counted")
    finally:
        await c.shutdown()
    assert broker.replies.snapshot() == {"replies": 22, "routed": 22, "dropped_late": 0,
                                         "dropped_gone": 0, "channels": 0}
    text = (await broker.metrics.render()).decode()
    assert "onceq_replies_routed_total 22.0" in text
    assert 'onceq_replies_dropped_total{reason="late"} 0.0' in text
    assert "onceq_request_reply_seconds_count 22.0" in text


async def test_no_responder_times_out_with_its_stable_code(rpc):
    _, addr = rpc
    async with Producer(addr) as p:
        with pytest.raises(RequestTimeout) as err:
            await p.request("rpc", b"nobody", timeout=0.2)
        assert err.value.code == ErrorCode.REQUEST_TIMEOUT == 55
        assert not err.value.retriable
        assert "within 0.2s" in err.value.message
        assert p.requests.stats["timeouts"] == 1 and p.requests.pending.waiting == 0


async def test_a_reply_after_the_deadline_is_dropped_by_the_broker_and_counted(rpc):
    broker, addr = rpc
    handed, gate = asyncio.Event(), asyncio.Event()

    async def slow(m):
        handed.set()
        await gate.wait()
        return b"too late"

    c = await start_responder(addr, responder(slow))
    try:
        async with Producer(addr) as p:
            with pytest.raises(RequestTimeout):
                await p.request("rpc", b"x", timeout=0.5)
            assert handed.is_set()
            gate.set()
            await wait_until(lambda: c.stats["replies_dropped_late"] == 1, 10, "late drop")
            assert p.requests.stats["late_replies"] == 0  # never reached the requester
    finally:
        await c.shutdown()
    assert broker.replies.dropped == {"late": 1, "gone": 0}
    assert broker.replies.routed == 0


async def test_a_reply_nobody_waits_for_is_dropped_by_the_client_and_counted(rpc):
    broker, addr = rpc
    handed, gate = asyncio.Event(), asyncio.Event()

    async def slow(m):
        handed.set()
        await gate.wait()
        return b"unwanted"

    c = await start_responder(addr, responder(slow))
    try:
        async with Producer(addr) as p:
            task = asyncio.create_task(p.request("rpc", b"x", timeout=30))
            await handed.wait()
            task.cancel()  # the caller gives up; the deadline is far away
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            await wait_until(lambda: p.requests.stats["late_replies"] == 1, 10,
                             "late reply at the client")
            assert p.requests.stats["given_up"] == 1
    finally:
        await c.shutdown()
    assert broker.replies.routed == 1


async def test_a_reply_to_a_requester_that_is_gone_is_dropped(rpc):
    broker, addr = rpc
    c = await start_responder(addr, responder(echo))
    try:
        async with Producer(addr) as p:  # a request whose requester never named its channel
            props = request_properties({}, "nobody@1@00", "1", 0)
            await p.send("rpc", Message(b"orphan", properties=props))
            await wait_until(lambda: c.stats["replies_dropped_gone"] == 1, 10, "gone drop")
    finally:
        await c.shutdown()
    assert broker.replies.dropped == {"late": 0, "gone": 1}


async def test_a_plain_message_gets_no_reply_and_a_channel_is_one_connections(rpc):
    _, addr = rpc
    got = asyncio.Event()
    errors: list[str] = []

    async def listener(msgs, ctx):
        for m in msgs:
            try:
                ctx.reply(m, b"yes")
            except ValueError as exc:
                errors.append(str(exc))
        got.set()

    c = await start_responder(addr, listener)
    try:
        async with Producer(addr) as p, Producer(addr) as thief:
            await p.send("rpc", b"plain")
            await got.wait()
            assert len(errors) == 1 and "is no request" in errors[0]
            assert (await p.request("rpc", b"y", timeout=10)).body == b"yes"
            thief.requests.channel = p.requests.channel  # another connection's channel
            with pytest.raises(OnceqError) as err:
                await thief.request("rpc", b"z", timeout=0.3)
            assert err.value.code == ErrorCode.CLIENT_ID_IN_USE
    finally:
        await c.shutdown()


async def test_the_cli_request_command(rpc):
    _, addr = rpc
    c = await start_responder(addr, responder(echo))
    try:
        ok = await asyncio.to_thread(CliRunner().invoke, cli,
                                     ["request", "rpc", "hi", "--timeout", "10", "-b", addr])
        assert ok.exit_code == 0, ok.output
        assert ok.output.strip().endswith("re:hi")
    finally:
        await c.shutdown()
    late = await asyncio.to_thread(CliRunner().invoke, cli,
                                   ["request", "rpc", "hi", "--timeout", "0.2", "-b", addr])
    assert late.exit_code == 2
    assert "REQUEST_TIMEOUT" in late.output


async def test_the_idempotency_layer_answers_a_retried_request_with_the_stored_reply(
        rpc, tmp_path):
    _, addr = rpc
    effects: list[str] = []

    def handle(m):
        effects.append(m.keys)
        return f"{m.body.decode()}#{len(effects)}".encode()

    guard = idempotent(responder(handle), store=f"sqlite:///{tmp_path}/dedup.db", key="keys")
    c = await start_responder(addr, guard)
    try:
        async with Producer(addr) as p:
            first = await p.request("rpc", Message(b"pay", keys="order-1"), timeout=10)
            again = await p.request("rpc", Message(b"pay", keys="order-1"), timeout=10)
            other = await p.request("rpc", Message(b"pay", keys="order-2"), timeout=10)
    finally:
        await c.shutdown()
        await guard.close()
    assert first.body == again.body == b"pay#1"
    assert first.unique_key != again.unique_key  # two messages, one effect
    assert other.body == b"pay#2"
    assert effects == ["order-1", "order-2"]
    assert guard.stats["replies_kept"] == 2 and guard.stats["replies_replayed"] == 1


# ------------------------------------------------------------------ responders in processes
async def spawn(addr: str, tmp_path: Path, name: str) -> asyncio.subprocess.Process:
    err = open(tmp_path / f"{name}.stderr", "ab")  # noqa: SIM115 - closed below
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(CHILD), "--addr", addr, "--group", "rr", "--topic", "rpc",
            "--store", f"sqlite:///{tmp_path}/dedup.db", "--effects",
            str(tmp_path / "effects.db"), "--hang-marker", str(tmp_path / "hang.marker"),
            stdout=asyncio.subprocess.PIPE, stderr=err)
    finally:
        err.close()
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert line.startswith(b"READY"), (line, (tmp_path / f"{name}.stderr").read_text())
    return proc


def effect_counts(path: Path) -> dict[str, int]:
    with sqlite3.connect(path, timeout=30) as conn:
        return dict(conn.execute("SELECT key, COUNT(*) FROM effects GROUP BY key"))


@pytest.mark.slow
async def test_three_responders_join_and_leave_one_killed_mid_request(rpc, tmp_path):
    broker, addr = rpc
    procs: dict[str, asyncio.subprocess.Process] = {}
    try:
        for n in ("a", "b"):
            procs[n] = await spawn(addr, tmp_path, n)
        victim, replies = await _kill_one_mid_request(addr, tmp_path, procs)
        assert broker.replies.routed >= 2 * 21  # first replies, retried ones, replays
        procs["c"].send_signal(signal.SIGTERM)
        out, _ = await procs["c"].communicate()
        assert procs["c"].returncode == 0
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    # the retried requests were answered from the dedup records, not run again
    done = json.loads(out.decode().split("DONE ", 1)[1])
    assert done["guard"]["replies_replayed"] >= 21
    with sqlite3.connect(tmp_path / "effects.db") as conn:
        (pid,), = conn.execute("SELECT pid FROM effects WHERE key = 'k-hang'")
    assert pid != procs[victim].pid  # the killed responder never made the effect
    assert replies["hang"].split(b"|")[1] == str(pid).encode()


async def _kill_one_mid_request(addr: str, tmp_path: Path,
                                procs: dict[str, asyncio.subprocess.Process]
                                ) -> tuple[str, dict[int | str, bytes]]:
    """Requests while responder c joins, the one handed HANG is SIGKILLed in its handler
    and another leaves; then every request is asked again: (the victim, the replies)."""
    keys: list[int | str] = [*range(20), "hang"]
    async with Producer(addr) as p:
        def ask(i: int | str) -> asyncio.Task:
            body = b"HANG" if i == "hang" else f"q{i}".encode()
            return asyncio.create_task(p.request("rpc", Message(body, keys=f"k-{i}"), 20))

        first = [ask(i) for i in [*range(12), "hang"]]
        waits = {asyncio.create_task(procs[n].stdout.readline()): n for n in procs}
        procs["c"] = await spawn(addr, tmp_path, "c")  # joins meanwhile
        done, pending = await asyncio.wait(waits, timeout=20,
                                           return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        assert done, "no responder was handed the HANG request"
        victim = waits[done.pop()]  # it printed IN-HANDLER: killed mid-request
        procs[victim].kill()
        await procs[victim].wait()
        second = [ask(i) for i in range(12, 20)]
        leaver = next(n for n in ("a", "b") if n != victim)
        procs[leaver].send_signal(signal.SIGTERM)  # leaves gracefully meanwhile
        assert await procs[leaver].wait() == 0
        got = await asyncio.gather(*first, *second)
        replies = dict(zip([*range(12), "hang", *range(12, 20)], [r.body for r in got],
                           strict=True))
        assert replies["hang"].startswith(b"HANG|")
        assert all(replies[i].startswith(f"q{i}|".encode()) for i in range(20))
        # each effect once, the HANG request's too (its responder died before its effect)
        once = {f"k-{i}": 1 for i in keys}
        assert effect_counts(tmp_path / "effects.db") == once
        # a retried request (a new message, the same business key) gets the same reply
        retried = await asyncio.gather(*(ask(i) for i in keys))
        assert dict(zip(keys, [r.body for r in retried], strict=True)) == replies
        assert effect_counts(tmp_path / "effects.db") == once
        assert p.requests.stats["timeouts"] == 0
    return victim, replies
