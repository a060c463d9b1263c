"""Consumer idempotency: each message's business effect happens once.

Records per (group, topic, dedup key) with owner-fenced claims (``record``), the policy for
ambiguous outcomes (``policy``).
"""

from .policy import Action, Ambiguous, Decision, Verdict, batch_reply, decide_action
from .record import (
    Claim,
    ClaimResult,
    Outcome,
    Record,
    Status,
    Ticket,
    decide_claim,
    decide_complete,
    decide_extend,
    decide_release,
    payload_hash,
)

__all__ = [
    "Action",
    "Ambiguous",
    "Claim",
    "ClaimResult",
    "Decision",
    "Outcome",
    "Record",
    "Status",
    "Ticket",
    "Verdict",
    "batch_reply",
    "decide_action",
    "decide_claim",
    "decide_complete",
    "decide_extend",
    "decide_release",
    "payload_hash",
]
