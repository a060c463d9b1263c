"""Consumer idempotency: each message's business effect happens once.

``idempotent(listener, store=URL)`` wraps a push-consumer listener (``listener``). Records
per (group, topic, dedup key) with owner-fenced claims (``record``, pure), the policy for
ambiguous outcomes (``policy``, pure), stores behind one small protocol (``store``:
in-memory; ``sql``: SQLite, MariaDB/MySQL, PostgreSQL; ``redis_store``).
``transactional(handler, db=URL)`` commits the dedup row with the business writes.
``PushConsumer(..., idempotency=URL or Idempotency(...))`` is the same guard as an option.
The guarded handler's context (``IdempotentContext``) carries each claim's ``FencingToken``.
"""

from .listener import IdempotentContext, IdempotentListener, idempotent
from .option import Idempotency
from .policy import Action, Ambiguous, Decision, Verdict, batch_reply, decide_action
from .record import (
    HISTORY_CHARS,
    Claim,
    ClaimResult,
    Event,
    FencingToken,
    Outcome,
    Record,
    Status,
    Ticket,
    decide_claim,
    decide_complete,
    decide_extend,
    decide_release,
    events,
    payload_hash,
)
from .store import (
    DedupStore,
    MemoryStore,
    StoreError,
    StoreStats,
    WriteLockTimeout,
    find_records,
    open_store,
)
from .transactional import TransactionalListener, transactional

__all__ = [
    "HISTORY_CHARS",
    "Action",
    "Ambiguous",
    "Claim",
    "ClaimResult",
    "Decision",
    "DedupStore",
    "Event",
    "FencingToken",
    "Idempotency",
    "IdempotentContext",
    "IdempotentListener",
    "MemoryStore",
    "Outcome",
    "Record",
    "Status",
    "StoreError",
    "StoreStats",
    "Ticket",
    "TransactionalListener",
    "Verdict",
    "WriteLockTimeout",
    "batch_reply",
    "decide_action",
    "decide_claim",
    "decide_complete",
    "decide_extend",
    "decide_release",
    "events",
    "find_records",
    "idempotent",
    "open_store",
    "payload_hash",
    "transactional",
]
