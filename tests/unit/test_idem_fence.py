"""Fencing tokens: their order and integer value (pure), and the token the guarded handler
finds in its context, over the in-memory store (the store suite checks every store)."""

from __future__ import annotations

import dataclasses

import pytest

from onceq.client.allocation import MessageQueue
from onceq.client.push import ConsumeContext, ConsumeStatus
from onceq.idempotency import (
    Claim,
    FencingToken,
    IdempotentContext,
    MemoryStore,
    Outcome,
    Record,
    Status,
    decide_claim,
    idempotent,
    payload_hash,
)
from tests.clock import FakeClock
from tests.unit.test_idem_listener import CountingStore, msg

MQ = MessageQueue("orders", 0)
LEASE = 60.0


def token(epoch: int = 1000, attempt: int = 1, owner: str = "o", key: str = "k"
          ) -> FencingToken:
    return FencingToken("g", "t", key, epoch, attempt, owner)


def test_tokens_are_ordered_by_epoch_then_attempt_like_their_integer_value():
    ordered = [token(1000, 1, "z"), token(1000, 2, "a"), token(1000, 3, "m"),
               token(1001, 1, "a"), token(5000, 7, "a")]
    assert sorted(reversed(ordered)) == ordered
    values = [int(t) for t in ordered]
    assert values == sorted(values) and len(set(values)) == len(values)
    assert [t.value for t in ordered] == values
    assert token(1000, 2) > token(1000, 1) and token(1000, 2) >= token(1000, 2)
    assert token(1000, 1) <= token(1000, 1) and not token(1000, 1) < token(1000, 1)
    assert int(token(3, 5)) == 3 << 20 | 5


def test_the_order_is_total_and_agrees_with_equality():
    a, b = token(1000, 2, "a"), token(1000, 2, "b")  # same claim number, other owners
    assert a != b and (a < b) != (b < a)
    assert a == token(1000, 2, "a") and hash(a) == hash(token(1000, 2, "a"))


def test_a_token_is_immutable_and_compares_only_with_tokens():
    t = token()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.attempt = 9  # type: ignore[misc]
    with pytest.raises(TypeError):
        _ = t < 5  # type: ignore[operator]


def test_out_of_range_values_are_refused():
    with pytest.raises(ValueError, match="out of range"):
        token(attempt=1 << 20)
    with pytest.raises(ValueError, match="out of range"):
        token(epoch=-1)
    assert int(token(epoch=(1 << 43) - 1, attempt=(1 << 20) - 1)) == (1 << 63) - 1


def test_takeover_release_and_a_record_made_again_all_give_larger_tokens():
    """The pure rules every store implements: attempt + 1 on a takeover and on the retry of
    a released claim (same epoch); a record past retention is made again with a later
    epoch, so the next token is larger although its attempt starts at 1 again."""
    now = 1_000_000.0

    def claim(owner: str) -> Claim:
        return Claim("g", "t", "k", owner, payload_hash(b"x"), lease_s=LEASE,
                     retention_s=3600.0)

    res, rec = decide_claim(None, claim("a"), now)
    first = FencingToken.of(res.record)
    assert (first.attempt, first.epoch, first.owner) == (1, int(now * 1000), "a")
    res, rec = decide_claim(rec, claim("b"), now + LEASE + 1)
    assert res.outcome is Outcome.TAKEN_OVER
    second = FencingToken.of(res.record)
    assert second > first and (second.attempt, second.epoch) == (2, first.epoch)
    assert rec is not None
    released = dataclasses.replace(rec, status=Status.RELEASED)
    res, rec = decide_claim(released, claim("c"), now + LEASE + 2)
    third = FencingToken.of(res.record)
    assert res.outcome is Outcome.CLAIMED and third > second and third.attempt == 3
    assert isinstance(rec, Record)
    later = rec.expires_at + 1
    res, _ = decide_claim(rec, claim("d"), later)
    fourth = FencingToken.of(res.record)
    assert res.outcome is Outcome.CLAIMED and fourth.attempt == 1
    assert fourth > third and int(fourth) > int(third)


def make_ctx(n: int) -> ConsumeContext:
    return ConsumeContext(MQ, n - 1, group="g")


class Fences:
    """A listener that records the context it was given (asserted outside)."""

    def __init__(self, fail: bool = False) -> None:
        self.ctxs: list[IdempotentContext] = []
        self.fences: list[tuple[FencingToken, ...]] = []
        self.single: list[FencingToken | Exception] = []
        self.fail = fail

    async def __call__(self, msgs, ctx):
        self.ctxs.append(ctx)
        self.fences.append(ctx.fences)
        try:
            self.single.append(ctx.fence)
        except (LookupError, ValueError) as exc:
            self.single.append(exc)
        if self.fail:
            raise RuntimeError("downstream refused")


async def test_the_handler_finds_each_claims_fencing_token_in_its_context():
    clock = FakeClock(1_000_000.0)
    store = MemoryStore(clock)
    inner = Fences()
    wrapped = idempotent(inner, store=store)
    assert await wrapped([msg(1)], make_ctx(1)) == ConsumeStatus.SUCCESS
    rec = await store.get("g", "orders", "UNIQ0001")
    [ctx] = inner.ctxs
    assert isinstance(ctx, IdempotentContext)
    assert inner.single == [FencingToken.of(rec)]
    assert (inner.single[0].key, inner.single[0].attempt, inner.single[0].owner) == (
        "UNIQ0001", 1, rec.owner)

    batch = [msg(2), msg(3), msg(4)]
    await wrapped(batch, make_ctx(3))
    fences = inner.fences[1]
    assert [f.key for f in fences] == ["UNIQ0002", "UNIQ0003", "UNIQ0004"]
    assert fences == tuple([FencingToken.of(await store.get("g", "orders", m.unique_key))
                            for m in batch])
    assert len({f.owner for f in fences}) == 3  # one claim (owner token) per message
    assert isinstance(inner.single[1], ValueError)  # ctx.fence: for a batch of one


async def test_only_the_messages_that_run_get_tokens_in_batch_order():
    """A batch of [fresh, busy elsewhere, fresh]: the handler runs on the two fresh ones
    and ``fences[i]`` belongs to its ``msgs[i]``."""
    store = MemoryStore(FakeClock(1_000_000.0))
    await store.claim_many([Claim("g", "orders", "UNIQ0002", "other", payload_hash(b"order 2"))])
    seen: list[tuple[list[str], list[str]]] = []

    async def handle(msgs, ctx):
        seen.append(([m.unique_key for m in msgs], [f.key for f in ctx.fences]))

    await idempotent(handle, store=store)([msg(1), msg(2), msg(3)], make_ctx(3))
    assert seen == [(["UNIQ0001", "UNIQ0003"], ["UNIQ0001", "UNIQ0003"])]


async def test_after_a_takeover_the_handler_holds_a_larger_token_than_the_stalled_owner():
    clock = FakeClock(1_000_000.0)
    store = MemoryStore(clock)
    [stalled] = await store.claim_many([Claim("g", "orders", "UNIQ0001", "stalled-member",
                                              payload_hash(b"order 1"), lease_s=LEASE)])
    clock.advance(LEASE + 1)  # the member that claimed it is paused past its lease
    inner = Fences()
    wrapped = idempotent(inner, store=store, lease_s=LEASE)
    await wrapped([msg(1)], make_ctx(1))
    assert wrapped.stats["taken_over"] == 1
    [fence] = inner.single
    old = FencingToken.of(stalled.record)
    assert fence > old and int(fence) > int(old)
    assert (fence.attempt, fence.epoch, old.attempt) == (2, old.epoch, 1)


async def test_the_retry_of_a_failed_handler_holds_a_larger_token():
    store = MemoryStore(FakeClock(1_000_000.0))
    inner = Fences(fail=True)
    wrapped = idempotent(inner, store=store)
    await wrapped([msg(1)], make_ctx(1))
    inner.fail = False
    await wrapped([msg(1)], make_ctx(1))
    first, second = inner.single
    assert second > first and (first.attempt, second.attempt) == (1, 2)


async def test_an_unguarded_batch_has_no_token_and_keeps_its_reply():
    """fail_open after a store error: no claim, so no token; the handler's partial
    success still reaches the consumer's context."""
    seen: list[object] = []

    async def handle(msgs, ctx):
        seen.append(ctx.fences)
        try:
            seen.append(ctx.fence)
        except LookupError as exc:
            seen.append(exc)
        ctx.ack_index = 0
        ctx.dlq_reasons[1] = "bad order"

    wrapped = idempotent(handle, store=CountingStore(fail_claims=True), fail_open=True)
    c = make_ctx(2)
    assert await wrapped([msg(1), msg(2)], c) == ConsumeStatus.SUCCESS
    assert seen[0] == () and isinstance(seen[1], LookupError)
    assert "unguarded" in str(seen[1])
    assert (c.ack_index, c.dlq_reasons) == (0, {1: "bad order"})


def test_the_context_is_a_consume_context_and_builds_tokens_once():
    rec = Record("g", "t", "k", Status.CONSUMING, "o", 3, 10.0, "", 1.5, 1.5, 99.0)
    ctx = IdempotentContext(MQ, 0, group="g", records=[rec])
    assert isinstance(ctx, ConsumeContext)
    assert ctx.fence == FencingToken("g", "t", "k", 1500, 3, "o")
    assert ctx.fences is ctx.fences
