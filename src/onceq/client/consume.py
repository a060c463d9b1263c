"""What a listener is given and what it returns: the consumer's public listener types.

A listener gets a batch of messages and a :class:`ConsumeContext`, and answers with a
:class:`ConsumeResult` (the acknowledged prefix of the batch; the rest retried, or
dead-lettered with a reason). The older style, a :class:`ConsumeStatus` (or None) with the
details set on the context (``ack_index``, ``delay_level``, ``suspend_ms``,
``dlq_reasons``), works as before: :meth:`ConsumeResult.of` turns it into the result
value, in this one place. Listener middleware (the idempotency layer) needs only these.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from ..log.record import MessageExt
from .allocation import MessageQueue
from .request_reply import is_request

__all__ = ["ConsumeContext", "ConsumeResult", "ConsumeStatus", "Listener", "Rest",
           "is_orderly", "orderly"]


class ConsumeStatus(StrEnum):
    SUCCESS = "SUCCESS"
    RECONSUME_LATER = "RECONSUME_LATER"  # concurrent: retry later through the retry topic
    SUSPEND = "SUSPEND"  # orderly: pause the queue, then retry the same messages in place


@dataclass(slots=True)
class ConsumeContext:
    """Passed to the listener with each batch.

    ``ack_index``: with SUCCESS, messages after this index are retried (partial success);
    the default covers the whole batch (concurrent mode). ``delay_level``: 0 lets the broker
    choose (3 + reconsume count), -1 sends the retried messages straight to the group's DLQ;
    a listener may set another level for its retries. ``group``: the consumer group.
    ``suspend_ms`` (orderly mode): how long to pause the queue after SUSPEND (0: the
    consumer's ``suspend_s`` setting; bounded to 10 ms..30 s). ``attempt`` (orderly mode):
    1 on the first call with these messages, 2 on the first retry in place, ...
    ``dlq_reasons``: batch index -> why that message is given up; the broker stores it in
    the message's ``DLQ_REASON`` property when the retry takes it to the DLQ.
    ``replies``: queue offset -> the reply body of each request answered with :meth:`reply`.
    """

    queue: MessageQueue
    ack_index: int
    delay_level: int = 0
    group: str = ""
    suspend_ms: int = 0
    attempt: int = 1
    dlq_reasons: dict[int, str] = field(default_factory=dict)
    replies: dict[int, bytes] = field(default_factory=dict)

    def reply(self, message: MessageExt, body: bytes | str) -> None:
        """Answer ``message``, a request (``Producer.request``), with ``body``. The reply
        goes to the requester once this call acknowledges the message (``ack_index`` covers
        it; a message retried is answered by the call that acknowledges it); with the
        idempotency layer, once the message's dedup record is stored with the reply, so a
        redelivered copy is answered with the same reply. ``ValueError`` for a message that
        is no request."""
        if not is_request(message):
            raise ValueError(f"{message.topic}@{message.queue_offset} is no request (no "
                             "reply channel): only messages sent by Producer.request have "
                             "a requester to answer")
        self.replies[message.queue_offset] = body.encode() if isinstance(body, str) \
            else bytes(body)

    def acked(self, size: int) -> int:
        """How many of a batch of ``size`` messages a SUCCESS acknowledges: those up to
        ``ack_index``, clamped to the batch (a negative index acknowledges none, never
        slices from the end)."""
        return _clamp(self.ack_index + 1, size)


def _clamp(acked: int, size: int) -> int:
    """An acknowledged prefix's length, within the batch: never negative (a negative index
    must not slice from the end) and never past its end."""
    return min(max(acked, 0), size)


class Rest(StrEnum):
    """What happens to the messages of a batch after its acknowledged prefix."""

    RETRY = "RETRY"  # concurrent: through the retry topic; orderly: again, in place
    DEAD_LETTER = "DEAD_LETTER"  # to the group's dead-letter queue (retrying cannot help)


@dataclass(frozen=True, slots=True)
class ConsumeResult:
    """A listener's answer on one batch: its first ``acked`` messages are done; the rest
    are retried (``delay_level``: 0 lets the broker choose; ``suspend_ms``: the pause of
    an orderly queue, 0 for the ``suspend_s`` setting) or dead-lettered, each with its
    reason in ``reasons`` (batch index -> text) when it has one."""

    acked: int
    rest: Rest = Rest.RETRY
    delay_level: int = 0
    suspend_ms: int = 0
    reasons: Mapping[int, str] = field(default_factory=dict)

    @classmethod
    def success(cls, acked: int | None = None) -> ConsumeResult:
        """All done (or the first ``acked``; the rest retried)."""
        return cls(2 ** 62 if acked is None else acked)

    @classmethod
    def retry(cls, acked: int = 0, *, delay_level: int = 0, suspend_ms: int = 0
              ) -> ConsumeResult:
        return cls(acked, Rest.RETRY, delay_level, suspend_ms)

    @classmethod
    def dead_letter(cls, acked: int = 0, reasons: Mapping[int, str] | None = None
                    ) -> ConsumeResult:
        return cls(acked, Rest.DEAD_LETTER, reasons=dict(reasons or {}))

    @classmethod
    def of(cls, returned: Any, ctx: ConsumeContext, size: int) -> ConsumeResult:
        """The result a listener's return value stands for, on a batch of ``size``: a
        ``ConsumeResult`` itself, or (the context style) a ``ConsumeStatus`` or None read
        with what the listener set on ``ctx``. Raises ValueError for anything else."""
        if (returned is None or returned is ConsumeStatus.SUCCESS) and not (
                ctx.delay_level or ctx.suspend_ms or ctx.dlq_reasons):
            acked = ctx.ack_index + 1  # the common answer, at once
            if not 0 <= acked <= size:
                acked = _clamp(acked, size)
            return _PREFIXES.get(acked) or _all_but(acked)
        if isinstance(returned, ConsumeResult):
            acked = _clamp(returned.acked, size)
            return returned if acked == returned.acked else \
                cls(acked, returned.rest, returned.delay_level, returned.suspend_ms,
                    returned.reasons)
        status = ConsumeStatus.SUCCESS if returned is None else ConsumeStatus(returned)
        acked = ctx.acked(size) if status is ConsumeStatus.SUCCESS else 0
        rest = (Rest.DEAD_LETTER if ctx.delay_level < 0 and status is not ConsumeStatus.SUSPEND
                else Rest.RETRY)
        return cls(acked, rest, max(ctx.delay_level, 0), ctx.suspend_ms,
                   dict(ctx.dlq_reasons))

    def reply(self, ctx: ConsumeContext) -> ConsumeStatus:
        """This result in the context style, for a caller that reads the context: sets
        ``ctx`` and returns the status (the inverse of :meth:`of`)."""
        ctx.ack_index = self.acked - 1
        if self.rest is Rest.DEAD_LETTER:
            ctx.delay_level = -1
        elif self.delay_level:
            ctx.delay_level = self.delay_level
        if self.suspend_ms:
            ctx.suspend_ms = self.suspend_ms
        ctx.dlq_reasons.update(self.reasons)
        return ConsumeStatus.SUCCESS


Listener = Callable[[list[MessageExt], ConsumeContext],
                    Awaitable[ConsumeResult | ConsumeStatus | None] | ConsumeResult
                    | ConsumeStatus | None]
L = TypeVar("L")


def orderly(listener: L) -> L:
    """Mark ``listener`` as an orderly listener: a push consumer given it consumes each
    queue strictly in order (one batch at a time, under the broker's queue lock)."""
    try:
        listener.onceq_orderly = True  # type: ignore[attr-defined]
    except AttributeError:  # e.g. a bound method
        raise TypeError(f"cannot mark {listener!r} as orderly: pass orderly=True to the "
                        "consumer instead") from None
    return listener


def is_orderly(listener: Any) -> bool:
    return getattr(listener, "onceq_orderly", False) is True


_PREFIXES: dict[int, ConsumeResult] = {}  # acked -> the plain result (batch sizes are few)


def _all_but(acked: int) -> ConsumeResult:
    """The plain result acknowledging ``acked`` messages (the rest retried), shared: a
    frozen result is the same whoever returns it."""
    r = _PREFIXES.get(acked)
    if r is None:
        r = ConsumeResult(acked)
        if len(_PREFIXES) < 4096:
            _PREFIXES[acked] = r
    return r
