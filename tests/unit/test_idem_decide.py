"""The pure dedup decisions: claims, fencing, ambiguous outcomes, payload checks."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from onceq.idempotency import (
    Action,
    Ambiguous,
    Claim,
    Outcome,
    Record,
    Status,
    Verdict,
    batch_reply,
    decide_action,
    decide_claim,
    decide_complete,
    decide_extend,
    decide_release,
    events,
    payload_hash,
)
from tests.clock import FakeClock

LEASE = 60.0
RETENTION = 86400.0


def claim(owner: str, key: str = "k", body: bytes = b"body", **kw) -> Claim:
    return Claim("g", "t", key, owner, payload_hash(body), lease_s=kw.pop("lease_s", LEASE),
                 retention_s=kw.pop("retention_s", RETENTION), **kw)


def same_but_history(a: Record | None, b: Record | None) -> bool:
    """Equal apart from the history (where a refused call notes a fenced-off owner)."""
    if a is None or b is None:
        return a is b
    return replace(a, history="") == replace(b, history="")


@dataclass
class Table:
    """One key's stored record, changed only through the pure decisions."""

    clock: FakeClock
    rec: Record | None = None
    log: list[str] = field(default_factory=list)

    def claim(self, c: Claim):
        res, new = decide_claim(self.rec, c, self.clock())
        if new is not None:
            self.rec = new
        return res

    def complete(self, owner: str) -> bool:
        ok, new = decide_complete(self.rec, owner, self.clock(), RETENTION)
        if new is not None:
            self.rec = new
        return ok

    def release(self, owner: str) -> bool:
        ok, new = decide_release(self.rec, owner, self.clock())
        if new is not None:
            self.rec = new
        return ok

    def extend(self, owner: str) -> bool:
        ok, new = decide_extend(self.rec, owner, self.clock(), LEASE, RETENTION)
        if new is not None:
            self.rec = new
        return ok


def test_fresh_claim_then_complete_then_duplicate_is_acked_without_running():
    t = Table(FakeClock())
    r = t.claim(claim("a"))
    assert r.outcome is Outcome.CLAIMED and r.runnable
    assert (r.record.status, r.record.owner, r.record.attempt) == (Status.CONSUMING, "a", 1)
    assert r.record.lease_until == t.clock() + LEASE
    assert t.complete("a")
    assert t.rec.status is Status.CONSUMED and t.rec.expires_at == t.clock() + RETENTION
    r2 = t.claim(claim("b"))
    assert r2.outcome is Outcome.DUPLICATE and not r2.runnable
    assert decide_action(r2, Ambiguous.REEXECUTE).action is Action.ACK
    assert t.rec.owner == "a"  # the duplicate changed nothing


def test_live_claim_makes_a_copy_wait_and_never_ack():
    t = Table(FakeClock())
    t.claim(claim("a"))
    t.clock.advance(LEASE - 0.001)
    r = t.claim(claim("b"))
    assert r.outcome is Outcome.BUSY
    assert decide_action(r, Ambiguous.REEXECUTE).action is Action.LATER
    assert t.rec.owner == "a"


def test_handler_failure_releases_and_the_redelivery_runs():
    t = Table(FakeClock())
    t.claim(claim("a"))
    assert t.release("a")
    assert (t.rec.status, t.rec.owner) == (Status.RELEASED, "a")
    r = t.claim(claim("b"))
    assert r.outcome is Outcome.CLAIMED and (r.record.owner, r.record.attempt) == ("b", 2)
    assert [e.event for e in events(t.rec)] == ["claimed", "released", "claimed"]


def test_expired_claim_is_taken_over_with_the_next_attempt_and_the_stale_owner_is_fenced():
    t = Table(FakeClock())
    t.claim(claim("a"))
    t.clock.advance(LEASE)
    r = t.claim(claim("b"))
    assert r.outcome is Outcome.TAKEN_OVER and r.runnable
    assert r.previous is not None and r.previous.owner == "a" and r.previous.attempt == 1
    assert (t.rec.owner, t.rec.attempt, t.rec.status) == ("b", 2, Status.CONSUMING)
    before = t.rec
    # the first owner wakes up: every compare-and-set is refused, nothing changes
    assert not t.extend("a")
    assert not t.complete("a")
    assert not t.release("a")
    assert same_but_history(t.rec, before)
    assert [(e.event, e.owner, e.attempt) for e in events(t.rec)][-3:] == [
        ("fenced-off", "a", 2)] * 3
    assert t.complete("b")
    assert t.rec.status is Status.CONSUMED and t.rec.owner == "b"


def test_extend_keeps_a_slow_handler_from_being_taken_over():
    t = Table(FakeClock())
    t.claim(claim("a"))
    for _ in range(10):
        t.clock.advance(LEASE / 3)
        assert t.extend("a")
        assert t.claim(claim("b")).outcome is Outcome.BUSY
    assert t.complete("a")


def test_owner_whose_lease_expired_but_was_not_taken_over_still_completes():
    t = Table(FakeClock())
    t.claim(claim("a"))
    t.clock.advance(LEASE * 2)
    assert t.extend("a")  # nobody took it: the lease is simply renewed
    t.clock.advance(LEASE * 2)
    assert t.complete("a")


def test_release_of_a_completed_record_is_refused():
    t = Table(FakeClock())
    t.claim(claim("a"))
    assert t.complete("a")
    assert not t.release("a") and not t.extend("a")
    assert t.complete("a")  # completing again is harmless
    assert t.rec.status is Status.CONSUMED


def test_records_past_retention_count_as_absent():
    t = Table(FakeClock())
    t.claim(claim("a"))
    t.complete("a")
    t.clock.advance(RETENTION)
    assert t.claim(claim("b")).outcome is Outcome.CLAIMED
    assert t.rec.attempt == 1 and t.rec.owner == "b"
    assert not t.complete("a")


def test_crashed_claim_stays_visible_for_the_retention_after_its_lease():
    t = Table(FakeClock())
    t.claim(claim("a"))
    t.clock.advance(LEASE + RETENTION - 1)
    assert t.claim(claim("b")).outcome is Outcome.TAKEN_OVER


def test_same_key_other_payload_is_a_conflict_in_every_state_and_can_be_turned_off():
    t = Table(FakeClock())
    t.claim(claim("a", body=b"one"))
    r = t.claim(claim("b", body=b"two"))
    assert r.outcome is Outcome.CONFLICT
    d = decide_action(r, Ambiguous.REEXECUTE)
    assert d.action is Action.DLQ and "another payload" in d.reason
    t.complete("a")
    assert t.claim(claim("b", body=b"two")).outcome is Outcome.CONFLICT
    assert t.claim(claim("b", body=b"two", check_payload=False)).outcome is Outcome.DUPLICATE
    assert t.claim(claim("b", body=b"one")).outcome is Outcome.DUPLICATE


def test_ambiguous_policies():
    t = Table(FakeClock())
    t.claim(claim("a"))
    t.clock.advance(LEASE + 1)
    r = t.claim(claim("b"))
    run = decide_action(r, Ambiguous.REEXECUTE)
    assert run.action is Action.RUN and "attempt 1 by a" in run.reason
    park = decide_action(r, Ambiguous.PARK)
    assert park.action is Action.DLQ and "ambiguous outcome" in park.reason
    assert decide_action(r, Ambiguous.RECONCILE).action is Action.RECONCILE


def test_batch_reply():
    A, L, D = Verdict.ACK, Verdict.LATER, Verdict.DLQ
    assert batch_reply([A, A, A]) == (2, 0)
    assert batch_reply([]) == (-1, 0)
    assert batch_reply([A, L, A]) == (0, 0)
    assert batch_reply([D, D]) == (-1, -1)
    assert batch_reply([A, D, L]) == (0, 0)  # the DLQ one is decided again on redelivery
    assert batch_reply([A, D, A]) == (0, 0)  # an acked one must not go to the DLQ


# ------------------------------------------------------------------ properties
# Two (or three) workers race on one key. A worker that respects leases performs its
# effect only while its own lease is live, and a live handler may extend; time jumps by
# arbitrary amounts between steps. However the steps interleave, the effect happens at
# most once while the key is inside its retention, and whoever's complete is accepted is
# the worker that did the effect.
step = st.tuples(st.integers(0, 2), st.sampled_from(["claim", "effect", "extend", "fail",
                                                     "wait"]),
                 st.floats(0, 2 * LEASE))


@settings(max_examples=400, deadline=None)
@given(steps=st.lists(step, max_size=60))
def test_interleaved_owners_never_produce_two_effects_while_leases_are_respected(steps):
    clock = FakeClock()
    t = Table(clock)
    token: dict[int, str] = {}
    lease_end: dict[int, float] = {}
    effects: list[str] = []
    serial = 0
    for worker, what, dt in steps:
        if what == "wait":
            clock.advance(dt)
            continue
        mine = token.get(worker)
        if what == "claim" and mine is None:
            serial += 1
            tok = f"w{worker}-{serial}"
            r = t.claim(claim(tok))
            if r.runnable:
                token[worker] = tok
                lease_end[worker] = r.record.lease_until
        elif what == "effect" and mine is not None:
            if clock() < lease_end[worker]:  # respects its lease: act, then complete at once
                effects.append(mine)
                assert t.complete(mine), "an owner inside its lease must win"
            else:
                t.release(mine)  # gave up; may learn it lost
            del token[worker]
        elif what == "extend" and mine is not None:
            if t.extend(mine):
                lease_end[worker] = t.rec.lease_until
            else:
                del token[worker]  # told it lost: stops
        elif what == "fail" and mine is not None:
            t.release(mine)
            del token[worker]
    assert len(effects) <= 1, effects
    if effects:
        assert t.rec is not None and t.rec.status is Status.CONSUMED
        assert t.rec.owner == effects[0]


op = st.tuples(st.sampled_from(["claim", "complete", "release", "extend", "wait"]),
               st.integers(0, 4), st.floats(0, 3 * LEASE))


@settings(max_examples=400, deadline=None)
@given(ops=st.lists(op, max_size=80))
def test_a_caller_that_does_not_own_the_record_never_changes_it(ops):
    clock = FakeClock()
    t = Table(clock)
    for what, who, dt in ops:
        owner = f"o{who}"
        before = t.rec
        if what == "wait":
            clock.advance(dt)
            continue
        if what == "claim":
            r = t.claim(claim(owner))
            if not r.runnable:
                assert t.rec == before
            elif (before is not None and before.alive(clock()) and before.owner == owner
                  and before.status is Status.CONSUMING):
                assert r.outcome is Outcome.CLAIMED and t.rec == before  # its own claim
            elif (before is not None and before.alive(clock())
                  and before.status is Status.RELEASED):
                assert r.outcome is Outcome.CLAIMED and t.rec.attempt == before.attempt + 1
            elif before is not None and before.alive(clock()):
                assert r.outcome is Outcome.TAKEN_OVER
                assert not before.leased(clock()) and t.rec.attempt == before.attempt + 1
            continue
        ok = getattr(t, what)(owner)
        owned = before is not None and before.owner == owner and before.alive(clock())
        if not owned:
            assert not ok and same_but_history(t.rec, before)
        if ok:
            assert owned


def test_a_claim_retried_by_its_owner_gets_its_own_claim_back():
    t = Table(FakeClock())
    first = t.claim(claim("a"))
    again = t.claim(claim("a"))  # the reply of the first claim was lost
    assert again.outcome is Outcome.CLAIMED and again.record == first.record


def test_redelivery_horizon_of_the_default_levels_is_4h45m40s():
    from onceq.idempotency.retention import (
        DEFAULT_DELAY_LEVELS_S,
        RetentionTooShort,
        check_retention,
        redelivery_horizon,
    )

    assert redelivery_horizon(DEFAULT_DELAY_LEVELS_S, 16) == 4 * 3600 + 45 * 60 + 40
    assert redelivery_horizon(DEFAULT_DELAY_LEVELS_S, 0) == 0
    # past the last level every retry waits the last delay
    assert redelivery_horizon([1.0, 2.0, 3.0], 4) == 12.0
    assert check_retention(86400, DEFAULT_DELAY_LEVELS_S) == 17140
    import pytest

    with pytest.raises(RetentionTooShort, match="shorter than the broker's redelivery"):
        check_retention(3600, DEFAULT_DELAY_LEVELS_S)
    assert check_retention(3600, DEFAULT_DELAY_LEVELS_S, strict=False) == 17140
