"""``idempotent(listener, store=...)``: a push-consumer listener whose business effect happens
once per dedup key.

For each listener batch: one ``claim_many`` round trip; the handler runs only on the
messages it may run (fresh claims, and taken-over ones as the ambiguous-outcome policy
says), while their leases are extended in the background every ``lease_s / 3``; then one
``complete_many`` for the messages the handler acknowledged (its ``ack_index``) and one
``release_many`` for the others. The reply to the consumer acknowledges exactly the leading
run of finished messages; the rest are retried (copies of finished ones are then
recognised as duplicates) or, when all of them are bound for it, sent to the DLQ.

The handler gets an ``IdempotentContext``: the consumer's context plus the fencing token of
each message's claim (``ctx.fences[i]`` for ``msgs[i]``; ``ctx.fence`` in a batch of one),
for downstream systems that must refuse the late write of an owner whose lease expired.

Store errors fail closed: the batch is consumed later and the handler does not run. With
``fail_open=True`` the handler runs unguarded (no claims, so no fencing tokens) and every
such message is logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import itertools
import logging
import os
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..client.consume import ConsumeContext, ConsumeResult, ConsumeStatus, Listener, Rest
from ..log.record import MessageExt
from .policy import Action, Ambiguous, Verdict, batch_reply, decide_action
from .record import Claim, ClaimResult, FencingToken, Outcome, Record, Ticket, payload_hash
from .retention import RetentionChecked
from .store import MAX_KEY_LEN, DedupStore, Purger, StoreError, open_store

__all__ = ["IdempotentContext", "IdempotentListener", "KeySpec", "idempotent"]

log = logging.getLogger("onceq.idempotency")

KeySpec = str | Callable[[MessageExt], str] | None
Reconcile = Callable[[str, MessageExt], bool | Awaitable[bool]]

DEFAULT_LEASE_S = 60.0
DEFAULT_RETENTION_S = 86400.0


@dataclass(slots=True)
class IdempotentContext(ConsumeContext):
    """The context the guarded handler gets: the consumer's ``ConsumeContext`` (its
    ``ack_index``, ``delay_level`` and ``dlq_reasons`` work as there) plus the fencing token
    of each message's claim.

    ``fences[i]`` is the token of ``msgs[i]``'s claim; ``fence`` is the token of a batch of
    one message. A downstream system keeps the last token it accepted per dedup key and
    refuses an older one (``FencingToken``): the late write of an owner paused longer than
    its lease then changes nothing. A batch run unguarded (``fail_open=True`` after a store
    error) has no claims: ``fences`` is empty and ``fence`` raises ``LookupError``.
    ``records``: the messages' dedup records as their claims left them.
    """

    records: Sequence[Record] = field(default=(), repr=False)
    unguarded: bool = False
    _fences: tuple[FencingToken, ...] | None = field(default=None, init=False, repr=False,
                                                     compare=False)

    @property
    def fences(self) -> tuple[FencingToken, ...]:
        """The fencing token of each message of the batch, in the batch's order (built on
        first use)."""
        if self._fences is None:
            self._fences = tuple(map(FencingToken.of, self.records))
        return self._fences

    @property
    def fence(self) -> FencingToken:
        """The fencing token of the batch's only message."""
        if self.unguarded:
            raise LookupError("no fencing token: the batch runs unguarded (fail_open after "
                              "a dedup store error)")
        if len(self.records) != 1:
            raise ValueError(f"ctx.fence is for a batch of one message; this batch has "
                             f"{len(self.records)}: use ctx.fences[i]")
        return self.fences[0]


def key_function(spec: KeySpec) -> Callable[[MessageExt], str]:
    """The dedup key of a message: ``None`` or ``"unique_key"`` (the message's unique key,
    stable across producer retries), ``"keys"`` (its first business key), ``"property:NAME"``
    (a user property), or a function of the message."""
    if spec is None or spec == "unique_key":
        return lambda m: m.unique_key
    if spec == "keys":
        def first_key(m: MessageExt) -> str:
            keys = m.key_list
            if not keys:
                raise KeyError("the message has no business key")
            return keys[0]
        return first_key
    if isinstance(spec, str) and spec.startswith("property:"):
        name = spec.split(":", 1)[1]

        def prop(m: MessageExt) -> str:
            if name not in m.properties:
                raise KeyError(f"the message has no property {name!r}")
            return str(m.properties[name])
        return prop
    if callable(spec):
        return spec
    raise ValueError(f"invalid dedup key {spec!r}: None, 'unique_key', 'keys', "
                     "'property:NAME' or a function of the message")


def _stored_key(key: str) -> str:
    if len(key) <= MAX_KEY_LEN and key:
        return key
    return "h:" + hashlib.blake2b(key.encode(), digest_size=32).hexdigest()


class IdempotentListener(RetentionChecked):
    """A listener wrapped by ``idempotent``; ``stats`` counts what happened."""

    def __init__(self, listener: Listener, *, store: DedupStore | str,
                 key: KeySpec = None, group: str | None = None,
                 lease_s: float = DEFAULT_LEASE_S, retention_s: float = DEFAULT_RETENTION_S,
                 ambiguous: Ambiguous | str = Ambiguous.REEXECUTE,
                 reconcile: Reconcile | None = None, check_payload: bool = True,
                 fail_open: bool = False, extend_leases: bool = True,
                 strict_retention: bool = True, purge_interval_s: float = 60.0,
                 purge_limit: int = 1000) -> None:
        if lease_s <= 0 or retention_s <= 0:
            raise ValueError("lease_s and retention_s must be > 0")
        self.listener = listener
        self.store: DedupStore = open_store(store) if isinstance(store, str) else store
        self._own_store = isinstance(store, str)  # opened here: closed by ``close()``
        self.key_of = key_function(key)
        self.group = group
        self.lease_s = lease_s
        self.retention_s = retention_s
        self.ambiguous = Ambiguous(ambiguous)
        if self.ambiguous is Ambiguous.RECONCILE and reconcile is None:
            raise ValueError("ambiguous='reconcile' needs a reconcile(key, message) callback")
        if reconcile is not None and self.ambiguous is Ambiguous.REEXECUTE:
            self.ambiguous = Ambiguous.RECONCILE  # giving a callback means using it
        self.reconcile = reconcile
        self.check_payload = check_payload
        self.fail_open = fail_open
        self.extend_leases = extend_leases
        self.strict_retention = strict_retention
        self.stats: Counter[str] = Counter()
        # records past retention are removed in bounded batches from here (0: never)
        self._purger = Purger(self.store.purge_expired, purge_interval_s, purge_limit,
                              self.stats)
        host = socket.gethostname()[:40]
        self._owner_prefix = f"{host}:{os.getpid()}:{os.urandom(3).hex()}:"
        self._serial = itertools.count(1)
        self._live: dict[str, Ticket] = {}  # owner -> claim whose handler is running
        self._tick: asyncio.TimerHandle | None = None
        self._extending: asyncio.Task[None] | None = None
        self._sync = not (inspect.iscoroutinefunction(listener)
                          or inspect.iscoroutinefunction(type(listener).__call__))

    # ------------------------------------------------------------------ the call
    async def __call__(self, msgs: list[MessageExt], ctx: ConsumeContext) -> ConsumeStatus:
        group = self.group or ctx.group
        if not group:
            raise ValueError("idempotent(): no consumer group (pass group=...)")
        self._purger.poke()
        verdicts: list[Verdict | None] = [None] * len(msgs)
        claims: list[tuple[int, Claim]] = []
        for i, m in enumerate(msgs):
            try:
                key = _stored_key(self.key_of(m))
            except Exception as exc:
                log.warning("no dedup key for %s@%d (%s): to the DLQ", m.topic,
                            m.queue_offset, exc)
                self.stats["no_key"] += 1
                verdicts[i] = Verdict.DLQ
                ctx.dlq_reasons[i] = f"idempotency: no dedup key ({exc})"
                continue
            claims.append((i, Claim(group, m.topic, key, self._new_owner(),
                                    payload_hash(m.body), self.lease_s, self.retention_s,
                                    self.check_payload)))
        try:
            results = await self.store.claim_many([c for _, c in claims])
        except StoreError as exc:
            self.stats["store_errors"] += 1
            if not self.fail_open:
                log.warning("dedup store unavailable, batch of %d consumed later: %s",
                            len(msgs), exc)
                return ConsumeStatus.RECONSUME_LATER
            return await self._unguarded(msgs, ctx, exc)
        to_run: list[tuple[int, Claim, Record]] = []
        claimed = 0
        for (i, c), res in zip(claims, results, strict=True):
            if res.outcome is Outcome.CLAIMED:  # the common case: run, nothing to log
                claimed += 1
                to_run.append((i, c, res.record))
                continue
            verdict = await self._verdict(msgs[i], c, res, ctx.dlq_reasons, i)
            if verdict is None:
                to_run.append((i, c, res.record))
            else:
                verdicts[i] = verdict
        if claimed:
            self.stats["claimed"] += claimed
        if to_run:
            for i, v in await self._run(msgs, ctx, to_run):
                verdicts[i] = v
        ack_index, delay = batch_reply([v or Verdict.LATER for v in verdicts])
        ctx.ack_index = ack_index
        if delay < 0 or ctx.delay_level == 0:
            ctx.delay_level = delay
        return ConsumeStatus.SUCCESS

    def _new_owner(self) -> str:
        return f"{self._owner_prefix}{next(self._serial)}"

    async def _verdict(self, m: MessageExt, c: Claim, res: ClaimResult,
                       dlq_reasons: dict[int, str], index: int) -> Verdict | None:
        """The verdict on one claimed message, or None: run the handler on it. A message
        bound for the DLQ gets its reason in ``dlq_reasons[index]``."""
        d = decide_action(res, self.ambiguous)
        self.stats[res.outcome.value.lower()] += 1
        if d.action is Action.RUN:
            if res.outcome is Outcome.TAKEN_OVER:
                log.warning("%s %s: %s", m.topic, c.key, d.reason)
            return None
        if d.action is Action.ACK:
            return Verdict.ACK
        if d.action is Action.LATER:
            return Verdict.LATER
        if d.action is Action.DLQ:
            self.stats["dlq"] += 1
            log.error("%s@%d key %s to the DLQ: %s", m.topic, m.queue_offset, c.key, d.reason)
            dlq_reasons[index] = f"idempotency: {d.reason}"
            return Verdict.DLQ
        # RECONCILE: the user checks the business system; the claim stays ours meanwhile
        try:
            if inspect.iscoroutinefunction(self.reconcile):
                done = await self.reconcile(c.key, m)
            else:  # a plain function may block (it asks a database): not on the loop
                done = await asyncio.get_running_loop().run_in_executor(
                    None, self.reconcile, c.key, m)
            if inspect.isawaitable(done):
                done = await done
        except Exception:
            log.exception("reconcile of %s failed; consumed later", c.key)
            return Verdict.LATER  # our claim expires, the next delivery asks again
        if not done:
            self.stats["reconciled_not_done"] += 1
            return None
        self.stats["reconciled_done"] += 1
        try:
            await self.store.complete_many([c.ticket], self.retention_s)
        except StoreError as exc:
            log.warning("reconciled %s as done but could not record it: %s", c.key, exc)
        return Verdict.ACK

    async def _run(self, msgs: list[MessageExt], ctx: ConsumeContext,
                   to_run: list[tuple[int, Claim, Record]]) -> list[tuple[int, Verdict]]:
        batch = [msgs[i] for i, _, _ in to_run]
        sub = IdempotentContext(ctx.queue, len(batch) - 1, ctx.delay_level, ctx.group,
                                records=[r for _, _, r in to_run])
        tickets = [c.ticket for _, c, _ in to_run]
        self._hold(tickets)
        try:
            result = await self._call(batch, sub)
        finally:
            for t in tickets:
                self._live.pop(t.owner, None)
        acked = result.acked
        if acked < len(batch):
            if result.rest is Rest.DEAD_LETTER:
                ctx.delay_level = -1
            elif result.delay_level:
                ctx.delay_level = result.delay_level
        for j, why in result.reasons.items():  # the handler's own reasons, if it gives any
            if 0 <= j < len(to_run):
                ctx.dlq_reasons[to_run[j][0]] = why
        self.stats["handled"] += acked
        out: list[tuple[int, Verdict]] = []
        if acked:
            done = tickets[:acked]
            won = await self._complete(done)
            for t, ok in zip(done, won, strict=True):
                if not ok:
                    self.stats["fenced"] += 1
                    log.warning("%s: the claim was taken over while the handler ran (lease "
                                "expired); the effect may have happened twice", t.key)
            out += [(i, Verdict.ACK) for i, _, _ in to_run[:acked]]
        if acked < len(batch):
            failed = tickets[acked:]
            try:
                released = await self.store.release_many(failed)
                self.stats["released"] += sum(released)
            except StoreError as exc:  # the claims expire; the redelivery waits for that
                self.stats["store_errors"] += 1
                log.warning("could not release %d claim(s): %s", len(failed), exc)
            out += [(i, Verdict.LATER) for i, _, _ in to_run[acked:]]
        return out

    async def _complete(self, tickets: list[Ticket]) -> list[bool]:
        """Mark ``CONSUMED``, retrying a failing store briefly: a record left ``CONSUMING``
        after the effect becomes an ambiguous outcome once its lease expires."""
        for attempt in range(3):
            try:
                return await self.store.complete_many(tickets, self.retention_s)
            except StoreError as exc:
                self.stats["store_errors"] += 1
                if attempt == 2:  # the effect happened: acknowledge anyway
                    log.error("effect done but CONSUMED not recorded for %d message(s): %s",
                              len(tickets), exc)
                    return [True] * len(tickets)
                await asyncio.sleep(0.05 * 4 ** attempt)
        raise AssertionError("unreachable")

    async def _call(self, batch: list[MessageExt], ctx: ConsumeContext) -> ConsumeResult:
        """The handler's answer on ``batch`` (either style, read by ``ConsumeResult.of``);
        an exception or a bad answer retries the batch."""
        try:
            if self._sync:
                loop = asyncio.get_running_loop()
                result: Any = await loop.run_in_executor(None, self.listener, batch, ctx)
            else:
                result = self.listener(batch, ctx)
            if inspect.isawaitable(result):
                result = await result
            return ConsumeResult.of(result, ctx, len(batch))
        except Exception:
            log.exception("listener failed on %s; claims released, batch retried", ctx.queue)
            return ConsumeResult.retry()

    def _hold(self, tickets: Sequence[Ticket]) -> None:
        """Keep the leases of ``tickets`` alive while the handler runs: one timer per
        listener extends every live claim every ``lease_s / 3`` (one store call for all of
        them, however many batches run at once; no task per batch)."""
        if not self.extend_leases:
            return
        for t in tickets:
            self._live[t.owner] = t
        if self._tick is None:
            self._tick = asyncio.get_running_loop().call_later(self.lease_s / 3, self._on_tick)

    def _on_tick(self) -> None:
        self._tick = None
        if not self._live:  # nothing running: the next batch sets the timer again
            return
        loop = asyncio.get_running_loop()
        if self._extending is None or self._extending.done():
            self._extending = loop.create_task(self._extend(list(self._live.values())))
        self._tick = loop.call_later(self.lease_s / 3, self._on_tick)

    async def _extend(self, live: list[Ticket]) -> None:
        try:
            ok = await self.store.extend_many(live, self.lease_s, self.retention_s)
        except StoreError as exc:
            self.stats["store_errors"] += 1
            log.warning("lease extension failed: %s", exc)
            return
        for t, won in zip(live, ok, strict=True):
            if won:
                self.stats["extended"] += 1
            elif self._live.pop(t.owner, None) is not None:  # not finished meanwhile
                self.stats["lease_lost"] += 1
                log.warning("%s: lease lost to another consumer while the handler runs",
                            t.key)

    async def _unguarded(self, msgs: list[MessageExt], ctx: ConsumeContext,
                         exc: StoreError) -> ConsumeStatus:
        for m in msgs:
            self.stats["unguarded"] += 1
            log.warning("fail_open: consuming %s@%d key %s WITHOUT dedup (store error: %s)",
                        m.topic, m.queue_offset, m.unique_key, exc)
        sub = IdempotentContext(ctx.queue, ctx.ack_index, ctx.delay_level, ctx.group,
                                ctx.suspend_ms, ctx.attempt, ctx.dlq_reasons, unguarded=True)
        result = await self._call(msgs, sub)
        if not result.acked and result.rest is Rest.RETRY and not result.delay_level:
            return ConsumeStatus.RECONSUME_LATER
        return result.reply(ctx)

    async def close(self) -> None:
        """Close the store if it was given as a URL (a store object stays its owner's)."""
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        if self._extending is not None:
            await asyncio.gather(self._extending, return_exceptions=True)
        await self._purger.wait()
        if self._own_store:
            await self.store.close()


def idempotent(listener: Listener, *, store: DedupStore | str, key: KeySpec = None,
               **options: Any) -> IdempotentListener:
    """Wrap a push-consumer listener (async or plain function) so that each message's
    effect happens once per dedup key::

        consumer = PushConsumer(addr, "orders", idempotent(handle, store="sqlite:///dedup.db"))

    ``store``: a ``DedupStore`` or a URL (``sqlite:///path``, ``redis://``, ``mysql://``,
    ``postgresql://``). ``key``: see ``key_function`` (default: the unique key). Options:
    ``group`` (default: the consumer's), ``lease_s`` (60), ``retention_s`` (1 day),
    ``ambiguous`` (``"reexecute"``, ``"park"``, ``"reconcile"``), ``reconcile(key, message)
    -> done?``, ``check_payload`` (True), ``fail_open`` (False), ``extend_leases`` (True),
    ``strict_retention`` (True: a consumer refuses to start when ``retention_s`` is shorter
    than the broker's redelivery horizon; False: it warns), ``purge_interval_s`` (60; 0:
    off) and ``purge_limit`` (1000): expired records removed in bounded batches.
    """
    return IdempotentListener(listener, store=store, key=key, **options)
