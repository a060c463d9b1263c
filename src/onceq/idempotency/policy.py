"""What a consumer does with each claim result, and how a batch's verdicts become one reply
(pure functions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from .record import ClaimResult, Outcome

__all__ = ["Action", "Ambiguous", "Decision", "Verdict", "batch_reply", "decide_action"]


class Ambiguous(StrEnum):
    """What to do when an expired ``CONSUMING`` claim is found: the previous attempt crashed
    and nobody knows whether its effect happened."""

    REEXECUTE = "reexecute"  # run the handler again (the default; the effect may repeat)
    PARK = "park"  # send the message to the group's DLQ with the reason, for a person
    RECONCILE = "reconcile"  # ask the user's ``reconcile(key, message) -> done?`` callback


class Action(StrEnum):
    RUN = "RUN"  # run the handler, then complete (or release on failure)
    RECONCILE = "RECONCILE"  # ask the reconcile callback first
    ACK = "ACK"  # acknowledge without running
    LATER = "LATER"  # consume later (retry with delay); never acknowledge
    DLQ = "DLQ"  # straight to the dead-letter queue, with a reason


class Verdict(StrEnum):
    """The final word on one message of a batch."""

    ACK = "ACK"
    LATER = "LATER"
    DLQ = "DLQ"


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str = ""


def decide_action(result: ClaimResult, ambiguous: Ambiguous) -> Decision:
    rec = result.record
    if result.outcome is Outcome.CLAIMED:
        return Decision(Action.RUN)
    if result.outcome is Outcome.DUPLICATE:
        return Decision(Action.ACK, f"already consumed by {rec.owner} (attempt {rec.attempt})")
    if result.outcome is Outcome.BUSY:
        return Decision(Action.LATER, f"being consumed by {rec.owner} (attempt {rec.attempt}) "
                                      f"until {rec.lease_until:.3f}")
    if result.outcome is Outcome.CONFLICT:
        return Decision(Action.DLQ, f"dedup key {rec.key!r} already seen with another payload "
                                    f"(hash {rec.payload_hash}); not acknowledged as a "
                                    "duplicate")
    prev = result.previous
    assert prev is not None and result.outcome is Outcome.TAKEN_OVER
    why = (f"ambiguous outcome: attempt {prev.attempt} by {prev.owner} stopped without "
           f"completing (lease expired at {prev.lease_until:.3f})")
    if ambiguous is Ambiguous.PARK:
        return Decision(Action.DLQ, why + "; parked for reconciliation")
    if ambiguous is Ambiguous.RECONCILE:
        return Decision(Action.RECONCILE, why)
    return Decision(Action.RUN, why + "; executing again")


def batch_reply(verdicts: Sequence[Verdict]) -> tuple[int, int]:
    """``(ack_index, delay_level)`` for a listener reply that acknowledges exactly the
    leading run of ``ACK`` verdicts.

    Everything after the first non-``ACK`` message is retried (a later copy of an
    acknowledged one is a duplicate the store recognises). The delay level is -1 (straight
    to the DLQ) only when every retried message is bound for the DLQ; otherwise 0 (the
    broker's schedule), and the DLQ-bound ones are decided again on their next delivery.
    """
    first = next((i for i, v in enumerate(verdicts) if v is not Verdict.ACK), len(verdicts))
    rest = verdicts[first:]
    delay = -1 if rest and all(v is Verdict.DLQ for v in rest) else 0
    return first - 1, delay
