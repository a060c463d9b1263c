"""``idempotent(listener)``: batches, partial success, policies and store failures, over the
in-memory store (the store suite shows the other stores keep the same rules)."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from onceq.client.allocation import MessageQueue
from onceq.client.push import ConsumeContext, ConsumeStatus
from onceq.idempotency import (
    Claim,
    MemoryStore,
    Outcome,
    Status,
    StoreError,
    idempotent,
    payload_hash,
)
from onceq.log.record import MessageExt
from tests.clock import FakeClock

MQ = MessageQueue("orders", 0)


def msg(i: int, body: bytes | None = None, **kw) -> MessageExt:
    return MessageExt("orders", 0, i, body if body is not None else f"order {i}".encode(),
                      f"UNIQ{i:04d}", **kw)


def ctx(n: int) -> ConsumeContext:
    return ConsumeContext(MQ, n - 1, group="g")


class Recorder:
    """An async listener that records the unique keys it handled (asserted outside)."""

    def __init__(self, ack_index: int | None = None, fail: bool = False,
                 sleep: float = 0.0) -> None:
        self.seen: list[str] = []
        self.ack_index = ack_index
        self.fail = fail
        self.sleep = sleep

    async def __call__(self, msgs, c):
        if self.sleep:
            await asyncio.sleep(self.sleep)
        self.seen += [m.unique_key for m in msgs]
        if self.fail:
            raise RuntimeError("payment service down")
        if self.ack_index is not None:
            c.ack_index = self.ack_index


class CountingStore(MemoryStore):
    def __init__(self, clock=None, fail_claims: bool = False) -> None:
        super().__init__(clock or FakeClock())
        self.calls: list[str] = []
        self.fail_claims = fail_claims

    async def claim_many(self, claims):
        self.calls.append("claim")
        if self.fail_claims:
            raise StoreError("redis dedup store: ConnectionError: connection refused")
        return await super().claim_many(claims)

    async def complete_many(self, tickets, retention_s):
        self.calls.append("complete")
        return await super().complete_many(tickets, retention_s)

    async def release_many(self, tickets):
        self.calls.append("release")
        return await super().release_many(tickets)


async def call(listener, msgs):
    c = ctx(len(msgs))
    status = await listener(msgs, c)
    return status, c.ack_index, c.delay_level


async def test_batch_runs_once_with_one_claim_and_one_complete_round_trip():
    store = CountingStore()
    inner = Recorder()
    wrapped = idempotent(inner, store=store)
    batch = [msg(i) for i in range(32)]
    assert await call(wrapped, batch) == (ConsumeStatus.SUCCESS, 31, 0)
    assert store.calls == ["claim", "complete"]
    assert len(inner.seen) == 32
    rec = await store.get("g", "orders", "UNIQ0007")
    assert rec.status is Status.CONSUMED
    # the same batch again (e.g. redelivered after a crash before the offset commit)
    assert await call(wrapped, batch) == (ConsumeStatus.SUCCESS, 31, 0)
    assert len(inner.seen) == 32
    assert wrapped.stats["duplicate"] == 32 and wrapped.stats["claimed"] == 32


async def test_plain_function_listener_runs_off_the_event_loop():
    threads = []

    def handle(msgs, c):
        threads.append(threading.current_thread())

    wrapped = idempotent(handle, store=MemoryStore())
    assert await call(wrapped, [msg(1)]) == (ConsumeStatus.SUCCESS, 0, 0)
    assert threads and threads[0] is not threading.main_thread()
    await call(wrapped, [msg(1)])
    assert len(threads) == 1


async def test_partial_success_completes_the_acked_part_and_releases_the_rest():
    store = CountingStore()
    inner = Recorder(ack_index=0)
    wrapped = idempotent(inner, store=store)
    assert await call(wrapped, [msg(1), msg(2), msg(3)]) == (ConsumeStatus.SUCCESS, 0, 0)
    assert store.calls == ["claim", "complete", "release"]
    assert (await store.get("g", "orders", "UNIQ0001")).status is Status.CONSUMED
    assert (await store.get("g", "orders", "UNIQ0002")).status is Status.RELEASED
    inner.ack_index = None
    assert await call(wrapped, [msg(2), msg(3)]) == (ConsumeStatus.SUCCESS, 1, 0)
    assert inner.seen == ["UNIQ0001", "UNIQ0002", "UNIQ0003", "UNIQ0002", "UNIQ0003"]


async def test_handler_failure_releases_and_the_retry_runs_again():
    store = MemoryStore()
    inner = Recorder(fail=True)
    wrapped = idempotent(inner, store=store)
    assert await call(wrapped, [msg(1)]) == (ConsumeStatus.SUCCESS, -1, 0)
    assert (await store.get("g", "orders", "UNIQ0001")).status is Status.RELEASED
    inner.fail = False
    assert await call(wrapped, [msg(1)]) == (ConsumeStatus.SUCCESS, 0, 0)
    assert inner.seen == ["UNIQ0001", "UNIQ0001"]


async def test_a_copy_being_consumed_elsewhere_is_retried_never_acked():
    clock = FakeClock()
    store = MemoryStore(clock)
    await store.claim_many([Claim("g", "orders", "UNIQ0002", "other-consumer",
                                  payload_hash(b"order 2"))])
    inner = Recorder()
    wrapped = idempotent(inner, store=store)
    # [fresh, busy, fresh]: only the first is acknowledged; the third ran and is recorded
    assert await call(wrapped, [msg(1), msg(2), msg(3)]) == (ConsumeStatus.SUCCESS, 0, 0)
    assert inner.seen == ["UNIQ0001", "UNIQ0003"]
    assert wrapped.stats["busy"] == 1
    assert await call(wrapped, [msg(3)]) == (ConsumeStatus.SUCCESS, 0, 0)  # a duplicate now
    assert inner.seen == ["UNIQ0001", "UNIQ0003"]


async def test_store_errors_fail_closed_by_default():
    inner = Recorder()
    wrapped = idempotent(inner, store=CountingStore(fail_claims=True))
    status, _, _ = await call(wrapped, [msg(1), msg(2)])
    assert status == ConsumeStatus.RECONSUME_LATER
    assert inner.seen == [] and wrapped.stats["store_errors"] == 1


async def test_fail_open_consumes_and_logs_every_unguarded_message(caplog):
    inner = Recorder()
    wrapped = idempotent(inner, store=CountingStore(fail_claims=True), fail_open=True)
    with caplog.at_level(logging.WARNING, logger="onceq.idempotency"):
        status, ack, _ = await call(wrapped, [msg(1), msg(2)])
    assert (status, ack) == (ConsumeStatus.SUCCESS, 1)
    assert inner.seen == ["UNIQ0001", "UNIQ0002"]
    unguarded = [r for r in caplog.records if "WITHOUT dedup" in r.getMessage()]
    assert len(unguarded) == 2 and wrapped.stats["unguarded"] == 2


async def _crashed_claim(store: MemoryStore, clock: FakeClock, i: int) -> None:
    await store.claim_many([Claim("g", "orders", f"UNIQ{i:04d}", "crashed",
                                  payload_hash(f"order {i}".encode()), lease_s=60)])
    clock.advance(61)


async def test_ambiguous_outcome_reexecute_by_default():
    clock = FakeClock()
    store = MemoryStore(clock)
    await _crashed_claim(store, clock, 1)
    inner = Recorder()
    wrapped = idempotent(inner, store=store)
    assert await call(wrapped, [msg(1)]) == (ConsumeStatus.SUCCESS, 0, 0)
    assert inner.seen == ["UNIQ0001"] and wrapped.stats["taken_over"] == 1
    rec = await store.get("g", "orders", "UNIQ0001")
    assert (rec.status, rec.attempt) == (Status.CONSUMED, 2)


async def test_ambiguous_outcome_park_sends_to_the_dlq_without_running(caplog):
    clock = FakeClock()
    store = MemoryStore(clock)
    await _crashed_claim(store, clock, 1)
    inner = Recorder()
    wrapped = idempotent(inner, store=store, ambiguous="park")
    with caplog.at_level(logging.ERROR, logger="onceq.idempotency"):
        assert await call(wrapped, [msg(1)]) == (ConsumeStatus.SUCCESS, -1, -1)
    assert inner.seen == []
    assert any("ambiguous outcome" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("done", [True, False])
async def test_ambiguous_outcome_reconcile_callback(done):
    clock = FakeClock()
    store = MemoryStore(clock)
    await _crashed_claim(store, clock, 1)
    asked = []

    async def reconcile(key, m):
        asked.append((key, m.queue_offset))
        return done

    inner = Recorder()
    wrapped = idempotent(inner, store=store, reconcile=reconcile)
    assert await call(wrapped, [msg(1)]) == (ConsumeStatus.SUCCESS, 0, 0)
    assert asked == [("UNIQ0001", 1)]
    assert inner.seen == ([] if done else ["UNIQ0001"])
    assert (await store.get("g", "orders", "UNIQ0001")).status is Status.CONSUMED


async def test_same_key_other_payload_goes_to_the_dlq_unless_the_check_is_off():
    store = MemoryStore()
    inner = Recorder()
    await call(idempotent(inner, store=store), [msg(1)])
    changed = msg(1, body=b"order 1, amount changed")
    assert await call(idempotent(inner, store=store), [changed]) == (
        ConsumeStatus.SUCCESS, -1, -1)
    assert await call(idempotent(inner, store=store, check_payload=False), [changed]) == (
        ConsumeStatus.SUCCESS, 0, 0)
    assert inner.seen == ["UNIQ0001"]


async def test_business_keys_property_keys_and_functions():
    store = MemoryStore()
    inner = Recorder()
    by_prop = idempotent(inner, store=store, key="property:order")
    a = msg(1, body=b"x", properties={"order": "A-1"})
    b = msg(2, body=b"x", properties={"order": "A-1"})  # an application re-send
    # the copy in the same batch waits (its twin is still CONSUMING), then is a duplicate
    assert await call(by_prop, [a, b]) == (ConsumeStatus.SUCCESS, 0, 0)
    assert await call(by_prop, [b]) == (ConsumeStatus.SUCCESS, 0, 0)
    assert inner.seen == ["UNIQ0001"] and by_prop.stats["duplicate"] == 1
    assert (await store.get("g", "orders", "A-1")).status is Status.CONSUMED
    by_keys = idempotent(inner, store=store, key="keys")
    await call(by_keys, [msg(3, body=b"y", keys="B-7 other")])
    assert (await store.get("g", "orders", "B-7")) is not None
    by_fn = idempotent(inner, store=store, key=lambda m: m.body.decode())
    await call(by_fn, [msg(4, body=b"z")])
    assert (await store.get("g", "orders", "z")) is not None
    # no such property: to the DLQ, the handler does not run
    before = list(inner.seen)
    assert await call(by_prop, [msg(5)]) == (ConsumeStatus.SUCCESS, -1, -1)
    assert inner.seen == before


async def test_running_handler_extends_its_lease_so_nobody_takes_it_over():
    store = MemoryStore()  # wall clock: the extension task runs for real
    slow = Recorder(sleep=0.8)
    wrapped = idempotent(slow, store=store, lease_s=0.3)
    task = asyncio.create_task(call(wrapped, [msg(1)]))
    outcomes = []
    for _ in range(3):
        await asyncio.sleep(0.2)
        [r] = await store.claim_many([Claim("g", "orders", "UNIQ0001", "second",
                                            payload_hash(b"order 1"), lease_s=0.3)])
        outcomes.append(r.outcome)
    assert await task == (ConsumeStatus.SUCCESS, 0, 0)
    assert outcomes == [Outcome.BUSY] * 3
    assert wrapped.stats["extended"] >= 2 and wrapped.stats["fenced"] == 0


async def test_without_extension_a_slow_handler_is_taken_over_and_learns_it_was_fenced():
    clock = FakeClock()
    store = MemoryStore(clock)
    started, may_end = asyncio.Event(), asyncio.Event()

    async def slow(msgs, c):
        started.set()
        await may_end.wait()

    wrapped = idempotent(slow, store=store, lease_s=0.2, extend_leases=False)
    task = asyncio.create_task(call(wrapped, [msg(1)]))
    await asyncio.wait_for(started.wait(), 5)
    clock.advance(0.3)  # the handler is still running: its lease (0.2 s) ran out
    [r] = await store.claim_many([Claim("g", "orders", "UNIQ0001", "second",
                                        payload_hash(b"order 1"), lease_s=5)])
    assert r.outcome is Outcome.TAKEN_OVER
    may_end.set()
    await task
    assert wrapped.stats["fenced"] == 1
    rec = await store.get("g", "orders", "UNIQ0001")
    assert (rec.owner, rec.status) == ("second", Status.CONSUMING)  # untouched


async def test_group_comes_from_the_consumer_or_is_given():
    store = MemoryStore()
    wrapped = idempotent(Recorder(), store=store, group="billing")
    await call(wrapped, [msg(1)])
    assert await store.get("billing", "orders", "UNIQ0001") is not None
    with pytest.raises(ValueError, match="no consumer group"):
        await idempotent(Recorder(), store=store)([msg(2)], ConsumeContext(MQ, 0))


async def test_expired_records_are_purged_in_bounded_batches_from_the_listener():
    clock = FakeClock()
    store = MemoryStore(clock)
    wrapped = idempotent(Recorder(), store=store, retention_s=10, purge_interval_s=0.05,
                         purge_limit=3)
    await call(wrapped, [msg(i) for i in range(5)])
    clock.advance(11)  # all five records are past retention
    await asyncio.sleep(0.06)
    await call(wrapped, [msg(10)])
    await wrapped.close()
    assert wrapped.stats["purged"] == 3  # one bounded batch
    assert len(store._recs) == 3  # two expired left for the next round, plus msg 10


async def test_a_briefly_failing_complete_is_retried_so_the_record_is_consumed():
    class Flaky(MemoryStore):
        fails = 2

        async def complete_many(self, tickets, retention_s):
            if self.fails:
                self.fails -= 1
                raise StoreError("postgresql dedup store: connection reset")
            return await super().complete_many(tickets, retention_s)

    store = Flaky()
    wrapped = idempotent(Recorder(), store=store)
    assert await call(wrapped, [msg(1)]) == (ConsumeStatus.SUCCESS, 0, 0)
    assert (await store.get("g", "orders", "UNIQ0001")).status is Status.CONSUMED
    assert wrapped.stats["store_errors"] == 2


async def test_a_plain_reconcile_function_runs_off_the_event_loop():
    clock = FakeClock()
    store = MemoryStore(clock)
    await _crashed_claim(store, clock, 1)
    threads = []

    def reconcile(key, m):
        threads.append(threading.current_thread())
        return True

    inner = Recorder()
    wrapped = idempotent(inner, store=store, reconcile=reconcile)
    assert await call(wrapped, [msg(1)]) == (ConsumeStatus.SUCCESS, 0, 0)
    assert inner.seen == [] and threads and threads[0] is not threading.main_thread()
