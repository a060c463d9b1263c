"""``idempotent(listener, store=...)``: a push-consumer listener whose business effect happens
once per dedup key.

For each listener batch: one claim; the handler runs only on the messages it may run
(fresh claims, and taken-over ones as the ambiguous-outcome policy says), while their
leases are extended in the background every ``lease_s / 3``; then one completion for the
messages the handler acknowledged (its ``ack_index``) and one ``release_many`` for the
others. The reply to the consumer acknowledges exactly the leading run of finished
messages; the rest are retried (copies of finished ones are then recognised as
duplicates) or, when all of them are bound for it, sent to the DLQ.

Per message the layer builds one tuple ``(topic, key, owner, payload hash)``
(``store.KeyClaim``); a store with ``claim_keys`` / ``complete_keys`` (SQL, Redis) answers
with results only for the claims that found a record, and the records of fresh claims are
built only if the handler reads them (``ctx.records``, ``ctx.fences``). Other stores get
``Claim`` and ``Ticket`` objects through ``claim_many`` / ``complete_many``.

**A completion rides with the next claims.** The stores send the completions and claims
of the listener batches that wait at the same time in one call: one transaction (SQLite),
one statement or one multi-statement call ending in its commit (PostgreSQL, MariaDB), one
script call (Redis). So the completion of batch N usually travels with the claims of the
batches after it. Why that is safe when the process dies at any point:

* The listener does not answer the consumer before its completion is durable: the
  call awaits the store call that carries it. Until then nothing of the batch is
  acknowledged, so no offset past it can be committed, and no message can be lost by
  a completion that never arrived (the redelivery comes).
* Dying before that call commits loses the completion, and with it the claims riding in
  the same call (SQL: one transaction; Redis: the script never ran). The effects of
  batch N happened; its records stay ``CONSUMING`` under the dead owner's lease. The
  redelivery of those messages (their offsets were never committed) finds them busy
  while the lease lasts (consumed later, never acknowledged, never run) and then taken
  over: the ambiguous-outcome policy decides, exactly as after a crash between an effect
  and its completion sent alone (``reexecute`` may repeat the effect, ``park`` and
  ``reconcile`` do not). Deferring adds no new state and no new rule: the window between
  an effect and its ``CONSUMED`` record exists without it, and it does not grow by more
  than the wait for the store call in flight. The claims of batch N+1 lost with it were
  never answered, so their handler never ran; their redelivery claims afresh.
* Dying after the call committed: the records are ``CONSUMED`` and the claims of batch
  N+1 exist; a redelivery of batch N is a duplicate, one of batch N+1 is busy, then
  taken over (its handler may or may not have run: the ordinary ambiguous outcome).
* A store call that fails keeps each caller's answer its own: a SQL group is run again
  by the full rules in a transaction of its own, and what a one-trip call committed
  before is recognised (a completion already made counts as won; a row a claim inserted
  carries its owner token, which the rules answer ``CLAIMED``, the same record). A
  completion that still fails after three tries is reported and the batch acknowledged
  (the effect happened), as before.

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
from ..client.request_reply import is_request
from ..log.record import MessageExt
from .policy import Action, Ambiguous, Verdict, batch_reply, decide_action
from .record import ClaimResult, FencingToken, Outcome, Record, Ticket, payload_hash
from .replies import get_replies, put_replies
from .retention import RetentionChecked
from .store import (
    MAX_KEY_LEN,
    DedupStore,
    KeyClaim,
    Purger,
    StoreError,
    claim_keys,
    complete_keys,
    fresh_record,
    open_store,
)

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


class _FreshRecords(Sequence[Record]):
    """The records of a batch's claims, built when read (``ctx.records``, ``ctx.fences``):
    a fresh claim's record follows from its tuple and the claim's time; ``overrides`` holds
    the records of the claims that found one (taken over, claimed again)."""

    __slots__ = ("_args", "_items", "_overrides")

    def __init__(self, group: str, now: float, lease_s: float, retention_s: float,
                 items: list[KeyClaim], overrides: dict[int, Record] | None = None) -> None:
        self._args = (group, now, lease_s, retention_s)
        self._items = items
        self._overrides = overrides or {}

    def __len__(self) -> int:
        return len(self._items)

    def _one(self, i: int) -> Record:
        rec = self._overrides.get(i)
        return rec if rec is not None else fresh_record(*self._args, self._items[i])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._one(j) for j in range(*i.indices(len(self._items)))]
        if i < 0:
            i += len(self._items)
        if not 0 <= i < len(self._items):
            raise IndexError(i)
        return self._one(i)


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
        # the claims whose handler is running, by batch: (group, claims, owners lost)
        self._live: dict[int, tuple[str, list[KeyClaim], set[str]]] = {}
        self._batches = itertools.count(1)
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
        # one tuple per message (topic, key, owner, payload hash): no object per claim
        items: list[KeyClaim] = []
        where: list[int] | None = None  # message index of each item, once one has no key
        verdicts: list[Verdict | None] | None = None  # built when one message is decided
        prefix, serial, key_of = self._owner_prefix, self._serial, self.key_of
        for i, m in enumerate(msgs):
            try:
                key = key_of(m)
                if not key or len(key) > MAX_KEY_LEN:
                    key = _stored_key(key)
            except Exception as exc:
                log.warning("no dedup key for %s@%d (%s): to the DLQ", m.topic,
                            m.queue_offset, exc)
                self.stats["no_key"] += 1
                if verdicts is None:
                    verdicts = [None] * len(msgs)
                    where = list(range(len(items)))
                verdicts[i] = Verdict.DLQ
                ctx.dlq_reasons[i] = f"idempotency: no dedup key ({exc})"
                continue
            if where is not None:
                where.append(i)
            items.append((m.topic, key, f"{prefix}{next(serial)}", payload_hash(m.body)))
        try:
            now, odd = await claim_keys(self.store, group, items, self.lease_s,
                                        self.retention_s, self.check_payload)
        except StoreError as exc:
            self.stats["store_errors"] += 1
            if not self.fail_open:
                log.warning("dedup store unavailable, batch of %d consumed later: %s",
                            len(msgs), exc)
                return ConsumeStatus.RECONSUME_LATER
            return await self._unguarded(msgs, ctx, exc)
        if not odd and where is None:
            # the common case: every message got a fresh claim and runs, in order
            self.stats["claimed"] += len(items)
            records: Sequence[Record] = _FreshRecords(group, now, self.lease_s,
                                                      self.retention_s, items)
            outcome = await self._run(msgs, ctx, group, items, records, None)
        else:
            if verdicts is None:
                verdicts = [None] * len(msgs)
            run_items: list[KeyClaim] = []
            run_index: list[int] = []
            overrides: dict[int, Record] = {}
            answered: list[tuple[int, KeyClaim]] = []  # requests consumed before
            claimed = 0
            for j, item in enumerate(items):
                i = j if where is None else where[j]
                res = odd.get(j)
                if res is not None and res.outcome is not Outcome.CLAIMED:
                    verdict = await self._verdict(msgs[i], group, item, res,
                                                  ctx.dlq_reasons, i)
                    if verdict is not None:
                        verdicts[i] = verdict
                        if (res.outcome is Outcome.DUPLICATE and verdict is Verdict.ACK
                                and is_request(msgs[i])):
                            answered.append((i, item))
                        continue
                else:
                    claimed += 1
                if res is not None:
                    overrides[len(run_items)] = res.record
                run_items.append(item)
                run_index.append(i)
            if claimed:
                self.stats["claimed"] += claimed
            if answered:
                await self._stored_replies(msgs, ctx, group, answered, verdicts)
            if run_items:
                records = _FreshRecords(group, now, self.lease_s, self.retention_s, run_items,
                                        overrides)
                batch = [msgs[i] for i in run_index]
                outcome = await self._run(batch, ctx, group, run_items, records, run_index)
                for n, i in enumerate(run_index):
                    verdicts[i] = Verdict.ACK if n < outcome else Verdict.LATER
            ack_index, delay = batch_reply([v or Verdict.LATER for v in verdicts])
            ctx.ack_index = ack_index
            if delay < 0 or ctx.delay_level == 0:
                ctx.delay_level = delay
            return ConsumeStatus.SUCCESS
        # every message ran: the reply acknowledges the prefix the handler acknowledged
        ctx.ack_index = outcome - 1
        return ConsumeStatus.SUCCESS

    async def _verdict(self, m: MessageExt, group: str, item: KeyClaim, res: ClaimResult,
                       dlq_reasons: dict[int, str], index: int) -> Verdict | None:
        """The verdict on one claimed message, or None: run the handler on it. A message
        bound for the DLQ gets its reason in ``dlq_reasons[index]``."""
        key = item[1]
        d = decide_action(res, self.ambiguous)
        self.stats[res.outcome.value.lower()] += 1
        if d.action is Action.RUN:
            if res.outcome is Outcome.TAKEN_OVER:
                log.warning("%s %s: %s", m.topic, key, d.reason)
            return None
        if d.action is Action.ACK:
            return Verdict.ACK
        if d.action is Action.LATER:
            return Verdict.LATER
        if d.action is Action.DLQ:
            self.stats["dlq"] += 1
            log.error("%s@%d key %s to the DLQ: %s", m.topic, m.queue_offset, key, d.reason)
            dlq_reasons[index] = f"idempotency: {d.reason}"
            return Verdict.DLQ
        # RECONCILE: the user checks the business system; the claim stays ours meanwhile
        try:
            if inspect.iscoroutinefunction(self.reconcile):
                done = await self.reconcile(key, m)
            else:  # a plain function may block (it asks a database): not on the loop
                done = await asyncio.get_running_loop().run_in_executor(
                    None, self.reconcile, key, m)
            if inspect.isawaitable(done):
                done = await done
        except Exception:
            log.exception("reconcile of %s failed; consumed later", key)
            return Verdict.LATER  # our claim expires, the next delivery asks again
        if not done:
            self.stats["reconciled_not_done"] += 1
            return None
        self.stats["reconciled_done"] += 1
        try:
            await complete_keys(self.store, group, [item], self.retention_s)
        except StoreError as exc:
            log.warning("reconciled %s as done but could not record it: %s", key, exc)
        return Verdict.ACK

    async def _run(self, batch: list[MessageExt], ctx: ConsumeContext, group: str,
                   items: list[KeyClaim], records: Sequence[Record],
                   index: list[int] | None) -> int:
        """Run the handler on ``batch`` (the messages it may run, their claims ``items``),
        complete what it acknowledged and release the rest; the number acknowledged.
        ``index``: each message's index in the listener's batch (None: the same)."""
        sub = IdempotentContext(ctx.queue, len(batch) - 1, ctx.delay_level, ctx.group,
                                replies=ctx.replies, records=records)
        token = self._hold(group, items)
        try:
            result = await self._call(batch, sub)
        finally:
            if token is not None:
                self._live.pop(token, None)
        acked = result.acked
        if acked < len(batch):
            if result.rest is Rest.DEAD_LETTER:
                ctx.delay_level = -1
            elif result.delay_level:
                ctx.delay_level = result.delay_level
        for j, why in result.reasons.items():  # the handler's own reasons, if it gives any
            if 0 <= j < len(items):
                ctx.dlq_reasons[j if index is None else index[j]] = why
        self.stats["handled"] += acked
        if acked:
            done = items if acked == len(items) else items[:acked]
            if ctx.replies:  # requests answered: their replies go into their records first
                await self._keep_replies(group, done, batch, ctx.replies)
            won = await self._complete(group, done)
            if not all(won):
                for item, ok in zip(done, won, strict=True):
                    if not ok:
                        self.stats["fenced"] += 1
                        log.warning("%s: the claim was taken over while the handler ran "
                                    "(lease expired); the effect may have happened twice",
                                    item[1])
        if acked < len(batch):
            failed = [Ticket(group, t, k, o) for t, k, o, _ in items[acked:]]
            try:
                released = await self.store.release_many(failed)
                self.stats["released"] += sum(released)
            except StoreError as exc:  # the claims expire; the redelivery waits for that
                self.stats["store_errors"] += 1
                log.warning("could not release %d claim(s): %s", len(failed), exc)
        return acked

    async def _keep_replies(self, group: str, done: list[KeyClaim], batch: list[MessageExt],
                            replies: dict[int, bytes]) -> None:
        """Store the replies of the requests of ``done`` (their claims, still
        ``CONSUMING``) in their dedup records, before their completion
        (``replies.py``)."""
        rows = [(t, k, o, replies[m.queue_offset])
                for (t, k, o, _), m in zip(done, batch[:len(done)], strict=True)
                if m.queue_offset in replies]
        if not rows:
            return
        try:
            kept = await put_replies(self.store, group, rows)
        except StoreError as exc:
            self.stats["store_errors"] += 1
            log.warning("%d reply(ies) sent but not kept: a redelivered copy of those "
                        "requests gets no reply: %s", len(rows), exc)
            return
        self.stats["replies_kept"] += sum(kept)
        if not all(kept):
            self.stats["replies_not_kept"] += len(kept) - sum(kept)

    async def _stored_replies(self, msgs: list[MessageExt], ctx: ConsumeContext, group: str,
                              answered: list[tuple[int, KeyClaim]],
                              verdicts: list[Verdict | None]) -> None:
        """Copies of requests consumed before: answer them with the replies their records
        keep (``ctx.replies``). When the store cannot say, they are consumed later."""
        try:
            stored = await get_replies(self.store, group, [(t, k) for _, (t, k, _, _)
                                                            in answered])
        except StoreError as exc:
            self.stats["store_errors"] += 1
            log.warning("stored replies of %d request(s) unavailable, consumed later: %s",
                        len(answered), exc)
            for i, _ in answered:
                verdicts[i] = Verdict.LATER
            return
        for (i, _), reply in zip(answered, stored, strict=True):
            if reply is None:
                self.stats["replies_missing"] += 1
            else:
                ctx.replies[msgs[i].queue_offset] = reply
                self.stats["replies_replayed"] += 1

    async def _complete(self, group: str, items: list[KeyClaim]) -> list[bool]:
        """Mark ``CONSUMED``, retrying a failing store briefly: a record left ``CONSUMING``
        after the effect becomes an ambiguous outcome once its lease expires."""
        for attempt in range(3):
            try:
                return await complete_keys(self.store, group, items, self.retention_s)
            except StoreError as exc:
                self.stats["store_errors"] += 1
                if attempt == 2:  # the effect happened: acknowledge anyway
                    log.error("effect done but CONSUMED not recorded for %d message(s): %s",
                              len(items), exc)
                    return [True] * len(items)
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

    def _hold(self, group: str, items: list[KeyClaim]) -> int | None:
        """Keep the leases of the claims ``items`` alive while the handler runs: one timer
        per listener extends every live claim every ``lease_s / 3`` (one store call for all
        of them, however many batches run at once; no task per batch). The batch's token
        in ``_live`` (None: extensions are off)."""
        if not self.extend_leases:
            return None
        token = next(self._batches)
        self._live[token] = (group, items, set())
        if self._tick is None:
            self._tick = asyncio.get_running_loop().call_later(self.lease_s / 3, self._on_tick)
        return token

    def _on_tick(self) -> None:
        self._tick = None
        if not self._live:  # nothing running: the next batch sets the timer again
            return
        loop = asyncio.get_running_loop()
        if self._extending is None or self._extending.done():
            live = [(token, Ticket(group, t, k, o))
                    for token, (group, items, lost) in self._live.items()
                    for t, k, o, _ in items if o not in lost]
            self._extending = loop.create_task(self._extend(live))
        self._tick = loop.call_later(self.lease_s / 3, self._on_tick)

    async def _extend(self, live: list[tuple[int, Ticket]]) -> None:
        try:
            ok = await self.store.extend_many([t for _, t in live], self.lease_s,
                                              self.retention_s)
        except StoreError as exc:
            self.stats["store_errors"] += 1
            log.warning("lease extension failed: %s", exc)
            return
        for (token, t), won in zip(live, ok, strict=True):
            if won:
                self.stats["extended"] += 1
                continue
            held = self._live.get(token)
            if held is not None and t.owner not in held[2]:  # not finished meanwhile
                held[2].add(t.owner)
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
                                ctx.suspend_ms, ctx.attempt, ctx.dlq_reasons, ctx.replies,
                                unguarded=True)
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
