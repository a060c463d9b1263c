"""Idempotent consumers over a real broker: a consumer SIGKILLed after its effects but
before its offset commit; the redelivery must not repeat any effect.

Effects are rows in a SQLite table written by the listeners; everything is asserted here,
outside the listeners (an assert inside one would be swallowed as a retry).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import sys
import time
import uuid
from pathlib import Path

import pytest

from onceq import Admin, Producer
from onceq.client.push import PushConsumer
from onceq.idempotency import idempotent, open_store
from tests.clock import FakeClock
from tests.helpers import wait_until
from tests.idem_consumer_proc import Effects
from tests.integration.test_idem_stores import require_server

CHILD = Path(__file__).resolve().parent.parent / "idem_consumer_proc.py"
N = 60


def store_url(kind: str, tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/dedup.db" if kind == "sqlite" else require_server(kind)


def effect_counts(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    with sqlite3.connect(path, timeout=30) as conn:
        try:
            rows = conn.execute("SELECT key, COUNT(*) FROM effects GROUP BY key").fetchall()
        except sqlite3.OperationalError:  # the child has not created the table yet
            return {}
    return dict(rows)


async def start_child(addr: str, group: str, url: str, table: str, effects: Path,
                      *extra: str) -> asyncio.subprocess.Process:
    err = open(effects.with_suffix(".stderr"), "ab")  # noqa: SIM115 - closed below
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(CHILD), "--addr", addr, "--group", group, "--topic", "T",
            "--store", url, "--table", table, "--effects", str(effects), *extra,
            stdout=asyncio.subprocess.PIPE, stderr=err)
    finally:
        err.close()
    line = await asyncio.wait_for(proc.stdout.readline(), 20)
    assert line.startswith(b"READY"), (line, effects.with_suffix(".stderr").read_text())
    return proc


def store_options(kind: str, table: str) -> dict[str, str]:
    return {"prefix": table + ":"} if kind == "redis" else {"table": table}


async def drop(store) -> None:
    if hasattr(store, "drop_table"):
        await store.drop_table()
    elif hasattr(store, "drop_all"):
        await store.drop_all()
    await store.close()


@pytest.mark.parametrize("kind", ["sqlite", "redis", "mysql", "postgresql"])
async def test_consumer_killed_after_effects_before_offset_commit(tmp_path, addr, kind):
    url = store_url(kind, tmp_path)
    table = f"onceq_k_{uuid.uuid4().hex[:10]}"
    effects_db = tmp_path / "effects.db"
    group = "billing"
    async with Admin(addr) as admin:
        await admin.create_topic("T", 2)
    async with Producer(addr) as p:
        sent = [r.unique_key for r in await p.send_batch("T", [f"order {i}".encode()
                                                               for i in range(N)])]
    checker = open_store(url, **store_options(kind, table))
    second: PushConsumer | None = None
    child = await start_child(addr, group, url, table, effects_db)
    try:
        await wait_until(lambda: len(effect_counts(effects_db)) == N, 30, "first effects")
        await wait_until_async(lambda: consumed(checker), N, 30)
        # the kill lands before the offsets of this work were committed
        async with Admin(addr) as admin:
            committed = [await admin.group_offset(group, "T", q) for q in range(2)]
        assert sum(c or 0 for c in committed) < N, committed
        child.kill()
        await child.wait()

        redelivered: list[str] = []
        effects = Effects(str(effects_db))

        async def handle(msgs, ctx):
            redelivered.extend(m.unique_key for m in msgs)
            for m in msgs:
                effects.apply(m.unique_key)

        store = open_store(url, **store_options(kind, table))
        wrapped = idempotent(handle, store=store)
        second = PushConsumer(addr, group, wrapped, consume_from="FIRST",
                              rebalance_interval_s=1.0)
        second.subscribe("T", "*")
        await second.start()
        await wait_until(lambda: wrapped.stats["duplicate"] >= N - sum(c or 0
                                                                      for c in committed),
                         30, "the redelivery")
        await second.shutdown()
        await store.close()
        counts = effect_counts(effects_db)
        assert sorted(counts) == sorted(sent)
        assert set(counts.values()) == {1}, {k: v for k, v in counts.items() if v != 1}
        assert redelivered == []  # the handler never ran on a redelivered copy
        assert wrapped.stats["duplicate"] >= N - sum(c or 0 for c in committed) > 0
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        if second is not None:
            await second.shutdown()
        await drop(checker)


async def consumed(store) -> int:
    return (await store.stats()).consumed


async def wait_until_async(fn, want: int, timeout: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    got = await fn()
    while got < want:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out: {got} of {want} records CONSUMED")
        await asyncio.sleep(0.05)
        got = await fn()


@pytest.mark.parametrize("policy", ["reexecute", "park", "reconcile"])
async def test_consumer_killed_between_effect_and_consumed_policy_decides(tmp_path, policy):
    """The child applies its effects and hangs before ``CONSUMED`` is written; it is
    SIGKILLed and its leases run out. The redelivery finds expired claims: ``reexecute``
    repeats the effects that happened (the residual window of the non-transactional
    mode), ``park`` sends those messages to the DLQ, ``reconcile`` asks the business table
    and repeats nothing."""
    from tests.helpers import running_broker
    from tests.integration.test_push_consumer import FAST_LEVELS

    n = 8
    url = f"sqlite:///{tmp_path}/dedup.db"
    effects_db = tmp_path / "effects.db"
    group = "billing"
    async with running_broker(str(tmp_path / "data"), delay_levels=FAST_LEVELS) as broker:
        addr = f"127.0.0.1:{broker.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        async with Producer(addr) as p:
            sent = [r.unique_key for r in await p.send_batch("T", [f"order {i}".encode()
                                                                   for i in range(n)])]
        child = await start_child(addr, group, url, "onceq_dedup", effects_db,
                                  "--hang-after-effect", "--lease", "1.0")
        try:
            await wait_until(lambda: len(effect_counts(effects_db)) >= 3, 30, "effects")
            await asyncio.sleep(0.3)  # more handlers may reach their effect (not required)
        finally:
            child.kill()
            await child.wait()
        before = effect_counts(effects_db)
        assert before and set(before.values()) == {1}
        clock = FakeClock(time.time())
        clock.advance(1.2)  # the killed child's leases (1.0 s) have run out for the next
        store = open_store(url, clock=clock)

        effects = Effects(str(effects_db))
        ran: list[str] = []

        def handle(msgs, ctx):
            for m in msgs:
                ran.append(m.unique_key)
                effects.apply(m.unique_key)

        opts = {"reconcile": lambda key, m: effects.done(key)} if policy == "reconcile" \
            else {"ambiguous": policy}
        wrapped = idempotent(handle, store=store, **opts)
        second = PushConsumer(addr, group, wrapped, consume_from="FIRST",
                              rebalance_interval_s=1.0)
        second.subscribe("T", "*")
        await second.start()
        n = len(sent)
        try:
            s = wrapped.stats
            await wait_until(lambda: s["handled"] + s["dlq"] + s["reconciled_done"]
                             + s["duplicate"] >= n, 30, "every message decided")
        finally:
            await second.shutdown()
            await wrapped.close()
            await store.close()
        after = effect_counts(effects_db)
        taken = wrapped.stats["taken_over"]
        assert taken >= len(before)  # every message with an effect was an expired claim
        if policy == "reexecute":
            assert sorted(after) == sorted(sent)
            assert {k for k, v in after.items() if v == 2} == set(before)
            assert set(after.values()) <= {1, 2}
        elif policy == "park":
            assert all(v == 1 for v in after.values())
            assert set(before) <= set(after) and not set(before) & set(ran)
            assert wrapped.stats["dlq"] == taken
            async with Admin(addr) as admin:
                lo, hi = await admin.dead_letter_offsets(group)
            assert hi - lo == taken
            from tests.integration.test_idem_option import dead_letters

            parked = await dead_letters(addr, group)
            assert len(parked) == taken and set(before) <= {m.unique_key for m in parked}
            for m in parked:  # whoever reads the DLQ sees why each message is there
                why = m.properties["DLQ_REASON"]
                assert why.startswith("idempotency: ambiguous outcome: attempt 1 by "), why
                assert why.endswith("parked for reconciliation"), why
        else:
            assert sorted(after) == sorted(sent) and set(after.values()) == {1}
            assert wrapped.stats["reconciled_done"] == len(before)


async def test_consumer_start_checks_the_retention_against_the_brokers_levels(addr, caplog):
    from onceq.idempotency import MemoryStore
    from onceq.idempotency.retention import RetentionTooShort

    async def handle(msgs, ctx):
        pass

    async with Admin(addr) as admin:
        await admin.create_topic("T", 1)
        status = await admin.broker_status()
    assert len(status["delay_levels"]) == 18 and status["delay_levels"][-1] == 7200
    short = idempotent(handle, store=MemoryStore(), retention_s=3600)
    c = PushConsumer(addr, "billing", short)
    c.subscribe("T")
    with pytest.raises(RetentionTooShort, match="17140s"):
        await c.start()
    warned = idempotent(handle, store=MemoryStore(), retention_s=3600, strict_retention=False)
    c = PushConsumer(addr, "billing", warned)
    c.subscribe("T")
    with caplog.at_level("WARNING", logger="onceq.idempotency"):
        await c.start()
    await c.shutdown()
    assert warned.horizon_s == 17140
    assert any("redelivery horizon" in r.getMessage() for r in caplog.records)
    ok = idempotent(handle, store=MemoryStore())  # the default retention: one day
    c = PushConsumer(addr, "billing", ok)
    c.subscribe("T")
    await c.start()
    await c.shutdown()


class Outage:
    """A TCP relay to a store server that can cut every connection and refuse new ones."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.up = True
        self.server: asyncio.AbstractServer | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _accept(self, reader, writer) -> None:
        if not self.up:
            writer.close()
            return
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            writer.close()
            return
        self.writers |= {writer, up_w}
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer))

    async def _pipe(self, reader, writer) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()
            self.writers.discard(writer)

    def cut(self) -> None:
        self.up = False
        for w in list(self.writers):
            w.transport.abort()
        self.writers.clear()

    def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


@pytest.mark.parametrize("kind", ["redis", "mysql", "postgresql"])
async def test_store_outage_fails_closed_and_consumption_resumes(tmp_path, kind):
    """The store becomes unreachable while consuming: nothing is consumed unguarded (the
    batches are retried), and when it returns every message is consumed exactly once."""
    from urllib.parse import urlsplit

    from tests.helpers import running_broker
    from tests.integration.test_push_consumer import FAST_LEVELS

    real = urlsplit(require_server(kind))
    outage = Outage(real.port)
    port = await outage.start()
    url = real._replace(netloc=real.netloc.replace(f":{real.port}", f":{port}")).geturl()
    table = f"onceq_o_{uuid.uuid4().hex[:10]}"
    effects: dict[str, int] = {}

    async def handle(msgs, ctx):
        for m in msgs:
            effects[m.unique_key] = effects.get(m.unique_key, 0) + 1

    store = open_store(url, **store_options(kind, table))
    checker = open_store(require_server(kind), **store_options(kind, table))  # not cut
    wrapped = idempotent(handle, store=store)
    async with running_broker(str(tmp_path / "data"), delay_levels=FAST_LEVELS) as broker:
        addr = f"127.0.0.1:{broker.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 2)
        consumer = PushConsumer(addr, "billing", wrapped, consume_from="FIRST",
                                max_reconsume=1000, rebalance_interval_s=1.0)
        consumer.subscribe("T")
        await consumer.start()
        try:
            async with Producer(addr) as p:
                first = [r.unique_key for r in await p.send_batch(
                    "T", [f"a{i}".encode() for i in range(20)])]
                await wait_until(lambda: len(effects) == 20, 30, "the first messages")
                await wait_until_async(lambda: consumed(checker), 20, 30)
                outage.cut()
                refused_before = consumer.stats["sent_back"]
                second = [r.unique_key for r in await p.send_batch(
                    "T", [f"b{i}".encode() for i in range(20)])]
                await wait_until(lambda: wrapped.stats["store_errors"] >= 3, 30,
                                 "store errors")
                # nothing may run while the store is away: every new message is tried
                # together (one pull, a listener call each) and sent back; twice as many
                # send-backs mean their retries were refused too
                await wait_until(lambda: consumer.stats["sent_back"]
                                 >= refused_before + 2 * len(second), 30,
                                 "the new messages to be refused and retried")
                during = dict(effects)
                outage.up = True
                await wait_until(lambda: len(effects) == 40, 60, "consumption to resume")
        finally:
            await consumer.shutdown()
            outage.close()
    try:
        assert set(during) == set(first)  # nothing ran while the store was away
        assert wrapped.stats["unguarded"] == 0
        assert sorted(effects) == sorted(first + second)
        assert set(effects.values()) == {1}
        assert (await checker.stats()).consumed == 40
    finally:
        await store.close()
        await drop(checker)


@pytest.mark.slow
async def test_sync_push_consumer_with_a_business_key_acks_application_resends(
        fast_retry_addr, tmp_path):
    """From plain code: an order sent twice by the application (two messages, two unique
    keys, one order id) is handled once when the dedup key is the order id."""
    import threading
    import time

    from onceq import Message, SyncProducer, SyncPushConsumer

    addr = fast_retry_addr
    async with Admin(addr) as admin:
        await admin.create_topic("T", 2)
    url = f"sqlite:///{tmp_path}/dedup.db"

    def body() -> tuple[list[str], dict]:
        handled: list[str] = []
        lock = threading.Lock()
        with SyncProducer(addr) as p:
            for i in range(20):
                p.send("T", Message(f"order {i}".encode(), properties={"order": f"O{i}"}))
            for i in range(0, 20, 2):  # the application sends every other order again
                p.send("T", Message(f"order {i}".encode(), properties={"order": f"O{i}"}))

        def handle(msgs, ctx):  # plain function
            with lock:
                handled.extend(m.properties["order"] for m in msgs)

        wrapped = idempotent(handle, store=url, key="property:order")
        c = SyncPushConsumer(addr, "billing", wrapped, subscriptions={"T": "*"},
                             consume_from="FIRST")
        with c:
            deadline = time.monotonic() + 45  # a re-send seen BUSY comes back from retry
            while wrapped.stats["handled"] + wrapped.stats["duplicate"] < 30:
                assert time.monotonic() < deadline, dict(wrapped.stats)
                time.sleep(0.05)
        return handled, dict(wrapped.stats)

    handled, stats = await asyncio.wait_for(asyncio.to_thread(body), 60)
    assert sorted(handled) == sorted(f"O{i}" for i in range(20))
    assert stats["duplicate"] == 10


@pytest.mark.parametrize("kind", ["sqlite", "redis", "mysql", "postgresql"])
async def test_a_crash_before_a_completion_riding_with_claims_commits(tmp_path, kind):
    """A batch's completion rides in the store call of the next batches' claims. The child
    dies in the first such call before it commits: the effects of those messages happened,
    their records stay ``CONSUMING`` under the dead owner's lease, and their offsets were
    never committed (the listener had not answered: it waits for its completion). The
    redelivery finds them busy while the lease lasts (neither run nor acknowledged), then
    taken over: the ambiguous-outcome policy decides (here the reconcile callback asks the
    business table, which says done). Nothing is lost and no effect happens twice."""
    from onceq.idempotency import Outcome, Status
    from onceq.idempotency.store import claim_keys
    from tests.helpers import running_broker

    url = store_url(kind, tmp_path)
    table = f"crash_{uuid.uuid4().hex[:8]}"
    effects_db = tmp_path / "effects.db"
    group = "billing"
    async with running_broker(str(tmp_path / "data")) as broker:
        addr = f"127.0.0.1:{broker.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        sent: list[str] = []
        child = await start_child(addr, group, url, table, effects_db,
                                  "--crash-in-completion", "--lease", "30", "--batch-size", "4")

        stop = asyncio.Event()

        async def produce() -> None:  # new claims keep coming while batches complete
            async with Producer(addr) as p:  # (until the crash: it needs a completion
                while len(sent) < 40_000 and not stop.is_set():  # and claims in one call)
                    sent.extend(r.unique_key for r in await p.send_batch(
                        "T", [f"order {len(sent) + j}".encode() for j in range(40)]))
                    await asyncio.sleep(0.02)

        producing = asyncio.create_task(produce())
        try:
            try:
                line = await asyncio.wait_for(child.stdout.readline(), 60)
            except TimeoutError:
                raise AssertionError(
                    f"no crash after 60 s: {len(sent)} sent, "
                    f"{len(effect_counts(effects_db))} consumed; the child's stderr: "
                    f"{effects_db.with_suffix('.stderr').read_text()[-3000:]}") from None
        finally:
            stop.set()  # not cancelled: a batch stored but cut off before its answer would
            await producing  # be consumed later without being in ``sent``
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):  # it may be dying
                    child.kill()
            await child.wait()
        assert line.startswith(b"CRASH "), (line, effects_db.with_suffix(".stderr").read_text())
        lost = line.decode().split()[1:]
        before = effect_counts(effects_db)
        assert lost and all(before.get(k) == 1 for k in lost)  # their effects happened

        store = open_store(url, **store_options(kind, table))
        try:
            for k in lost:  # the completion never reached the store
                rec = await store.get(group, "T", k)
                assert rec is not None and rec.status is Status.CONSUMING, (k, rec)
            # a copy now, under the dead owner's live lease: busy (consumed later)
            _, odd = await claim_keys(store, group, [("T", k, f"probe-{k}", "")
                                                     for k in lost], 5.0, 86400.0, True)
            assert {r.outcome for r in odd.values()} == {Outcome.BUSY} and len(odd) == len(lost)
        finally:
            await store.close()

        clock = FakeClock(time.time())
        clock.advance(31)  # the dead owner's leases (30 s) are over for the next consumer
        store = open_store(url, clock=clock, **store_options(kind, table))
        effects = Effects(str(effects_db))
        ran: list[str] = []

        def handle(msgs, ctx):
            for m in msgs:
                ran.append(m.unique_key)
                effects.apply(m.unique_key)

        wrapped = idempotent(handle, store=store, reconcile=lambda key, m: effects.done(key))
        second = PushConsumer(addr, group, wrapped, consume_from="FIRST",
                              rebalance_interval_s=1.0, batch_size=4)
        second.subscribe("T", "*")
        await second.start()
        try:  # the messages acknowledged before the crash are not delivered again
            await wait_until(lambda: len(effect_counts(effects_db)) >= len(sent), 60,
                             "every message's effect")
            await wait_until(lambda: wrapped.stats["reconciled_done"] >= len(lost), 30,
                             "the lost completions reconciled")
        finally:
            await second.shutdown()
            await wrapped.close()
            await drop(store)
        after = effect_counts(effects_db)
        assert sorted(after) == sorted(sent) and set(after.values()) == {1}
        assert not set(lost) & set(ran)  # taken over and reconciled, not run again
        assert wrapped.stats["taken_over"] >= len(lost)
        assert wrapped.stats["reconciled_done"] >= len(lost)
