"""The Redis dedup store: one hash per record, Lua scripts for atomic claims and
compare-and-set, key TTLs for retention (redis-py asyncio).

A record lives at ``<prefix><group>:<topic>:<key>`` (group and topic names cannot contain
``:``) with the fields ``st own att lu ph ca ua ex`` and a TTL that ends at its
``expires_at``. Every script walks its keys in order inside Redis, so a batch is one round
trip and atomic. Times are the store clock's (passed as arguments, stored as given); TTLs
are relative, so the Redis server's own clock plays no part.

The claim script only decides what to write; it returns each key's record as it found it,
and the client derives the result with ``record.decide_claim`` (the same rules, the same
arguments), checking that both agree. On the listener's path (``claim_keys``,
``complete_keys``) one script (``_OPS``) completes and claims the keys of several batches
in one call, and answers a fresh claim with one character. All keys of a batch must be on
one Redis server (no cross-slot batches on a cluster).
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .record import (
    HISTORY_CHARS,
    Claim,
    ClaimResult,
    Outcome,
    Record,
    Status,
    Ticket,
    decide_claim,
    history_line,
)
from .store import MAX_KEY_LEN, Clock, KeyClaim, StoreError, StoreStats

__all__ = ["RedisStore"]

_FIELDS = ("st", "own", "att", "lu", "ph", "ca", "ua", "ex", "hi")

# appends an event line to a record's history, keeping its last HISTORY_CHARS characters
_HISTORY = """
local function hist(old, at, event, att, owner)
  local h = (old or '') .. at .. ' ' .. event .. ' ' .. att .. ' ' .. owner .. '\\n'
  if #h > CAP then h = string.sub(h, -CAP) end
  return h
end
""".replace("CAP", str(HISTORY_CHARS))

# one claim of key k by the rules of ``decide_claim``: the outcome, and the record as found
# (nil when the key had none, or one past its retention: a fresh claim). Uses the script's
# ``now`` and ``at``, and ARGV[1] (now as stored)
_CLAIM_KEY = """
local function claim(k, owner, ph, check, lu, ex, ttl)
  local r = redis.call('HMGET', k, 'st', 'own', 'att', 'lu', 'ph', 'ca', 'ua', 'ex', 'hi')
  if (not r[1]) or tonumber(r[8]) <= now then
    if r[1] then redis.call('DEL', k) end  -- past retention: as good as absent
    redis.call('HSET', k, 'st', 'CONSUMING', 'own', owner, 'att', '1', 'lu', lu, 'ph', ph,
               'ca', ARGV[1], 'ua', ARGV[1], 'ex', ex, 'hi', hist('', at, 'claimed', 1, owner))
    redis.call('PEXPIRE', k, ttl)
    return 'CLAIMED', nil
  end
  local outcome
  if r[1] == 'RELEASED' then
    local nph, att = ph, tonumber(r[3]) + 1
    if nph == '' then nph = r[5] end
    redis.call('HSET', k, 'st', 'CONSUMING', 'own', owner, 'att', tostring(att), 'lu', lu,
               'ph', nph, 'ua', ARGV[1], 'ex', ex, 'hi', hist(r[9], at, 'claimed', att, owner))
    redis.call('PEXPIRE', k, ttl)
    outcome = 'CLAIMED'
  elseif r[2] == owner and r[1] == 'CONSUMING' then
    outcome = 'CLAIMED'
  elseif check == '1' and ph ~= '' and r[5] ~= '' and ph ~= r[5] then
    outcome = 'CONFLICT'
  elseif r[1] == 'CONSUMED' then
    outcome = 'DUPLICATE'
  elseif tonumber(r[4]) > now then
    outcome = 'BUSY'
  else
    local nph, att = ph, tonumber(r[3]) + 1
    if nph == '' then nph = r[5] end
    redis.call('HSET', k, 'own', owner, 'att', tostring(att), 'lu', lu, 'ph', nph,
               'ua', ARGV[1], 'ex', ex, 'hi', hist(r[9], at, 'taken-over', att, owner))
    redis.call('PEXPIRE', k, ttl)
    outcome = 'TAKEN_OVER'
  end
  return outcome, r
end
"""

# ARGV: now, then one string holding, per key, six fields each ended by a newline: owner,
# payload hash, check ("1"/"0"), lease end, expiry, ttl ms (one argument instead of six per
# key: the client encodes and the server parses far fewer arguments); now as the history
# shows it
_CLAIM = _HISTORY + """
local now, at = tonumber(ARGV[1]), ARGV[3]
""" + _CLAIM_KEY + """
local f = {}
for v in string.gmatch(ARGV[2], '([^\\n]*)\\n') do f[#f + 1] = v end
if #f ~= 6 * #KEYS then return redis.error_reply('onceq: bad claim arguments') end
local out = {}
for i, k in ipairs(KEYS) do
  local b = (i - 1) * 6
  local owner, ph, check = f[b + 1], f[b + 2], f[b + 3]
  local lu, ex, ttl = f[b + 4], f[b + 5], f[b + 6]
  local outcome, r = claim(k, owner, ph, check, lu, ex, ttl)
  if r then
    out[i] = {outcome, r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9] or ''}
  else
    out[i] = outcome  -- no record before: the outcome alone (a smaller reply)
  end
end
return out
"""

# ARGV: now, mode, new lease end, new expiry, ttl ms, then the owners (one per key, each
# ended by a newline, in one argument), now as the history shows it.
# mode "complete": CONSUMING -> CONSUMED (already CONSUMED by the owner: ok, unchanged);
# "release": CONSUMING -> RELEASED; "extend": push a CONSUMING claim's lease. A live record
# of another owner notes the stale owner as fenced off.
_CAS = _HISTORY + """
local now, mode, at = tonumber(ARGV[1]), ARGV[2], ARGV[7]
local event = ({complete = 'completed', release = 'released', extend = 'extended'})[mode]
local owners = {}
for v in string.gmatch(ARGV[6], '([^\\n]*)\\n') do owners[#owners + 1] = v end
if #owners ~= #KEYS then return redis.error_reply('onceq: bad owner arguments') end
local out = {}
for i, k in ipairs(KEYS) do
  local r = redis.call('HMGET', k, 'st', 'own', 'ex', 'att', 'hi')
  local ok = 0
  local alive = r[3] and tonumber(r[3]) > now
  if alive and r[2] == owners[i] then
    if r[1] == 'CONSUMING' then
      ok = 1
      local h = hist(r[5], at, event, r[4], r[2])
      if mode == 'complete' then
        redis.call('HSET', k, 'st', 'CONSUMED', 'ua', ARGV[1], 'ex', ARGV[4], 'hi', h)
        redis.call('PEXPIRE', k, ARGV[5])
      elseif mode == 'release' then
        redis.call('HSET', k, 'st', 'RELEASED', 'lu', ARGV[1], 'ua', ARGV[1], 'hi', h)
      else
        redis.call('HSET', k, 'lu', ARGV[3], 'ua', ARGV[1], 'ex', ARGV[4], 'hi', h)
        redis.call('PEXPIRE', k, ARGV[5])
      end
    elseif mode == 'complete' and r[1] == 'CONSUMED' then
      ok = 1
    end
  elseif alive then
    redis.call('HSET', k, 'hi', hist(r[5], at, 'fenced-off', r[4], owners[i]))
  end
  out[i] = ok
end
return out
"""

# The listener's path (``RedisStore.claim_keys``, ``complete_keys``): the completions and
# the claims of a merged group in one script call, completions first. KEYS: the NC keys to
# complete, then the keys to claim. ARGV: now, now as the history shows it, NC, one string
# of three fields per completion (owner, expiry, ttl ms), one of six per claim (as
# ``_CLAIM``), each field ended by a newline. Reply: one character per completion ("1":
# won), one per claim ("1": the key had no record, a fresh claim), then, for each claim
# that found a record, the outcome and the record as found (as ``_CLAIM``).
_OPS = _HISTORY + """
local now, at, nc = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
""" + _CLAIM_KEY + """
local cf, f = {}, {}
for v in string.gmatch(ARGV[4], '([^\\n]*)\\n') do cf[#cf + 1] = v end
for v in string.gmatch(ARGV[5], '([^\\n]*)\\n') do f[#f + 1] = v end
if #cf ~= 3 * nc or #f ~= 6 * (#KEYS - nc) then
  return redis.error_reply('onceq: bad arguments')
end
local done = {}
for i = 1, nc do
  local k, b = KEYS[i], (i - 1) * 3
  local owner = cf[b + 1]
  local r = redis.call('HMGET', k, 'st', 'own', 'ex', 'att', 'hi')
  local ok = '0'
  local alive = r[3] and tonumber(r[3]) > now
  if alive and r[2] == owner then
    if r[1] == 'CONSUMING' then
      ok = '1'
      redis.call('HSET', k, 'st', 'CONSUMED', 'ua', ARGV[1], 'ex', cf[b + 2],
                 'hi', hist(r[5], at, 'completed', r[4], owner))
      redis.call('PEXPIRE', k, cf[b + 3])
    elseif r[1] == 'CONSUMED' then
      ok = '1'
    end
  elseif alive then
    redis.call('HSET', k, 'hi', hist(r[5], at, 'fenced-off', r[4], owner))
  end
  done[i] = ok
end
local out = {table.concat(done), ''}
local fresh = {}
for i = nc + 1, #KEYS do
  local k, b = KEYS[i], (i - nc - 1) * 6
  local owner, ph, check = f[b + 1], f[b + 2], f[b + 3]
  local lu, ex, ttl = f[b + 4], f[b + 5], f[b + 6]
  local outcome, r = claim(k, owner, ph, check, lu, ex, ttl)
  if r then
    fresh[#fresh + 1] = '0'
    out[#out + 1] = {outcome, r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9] or ''}
  else
    fresh[#fresh + 1] = '1'
  end
end
out[2] = table.concat(fresh)
return out
"""

_OUTCOMES = {o.value: o for o in Outcome}
_LANES = 2  # script calls of one kind in flight at once; more batches wait and merge
_MERGE_MAX = 512  # keys per merged script call at most (a script blocks Redis while it runs)


class _Lane:
    """The batches of one kind of call waiting to be sent, and the calls in flight."""

    __slots__ = ("active", "queue")

    def __init__(self) -> None:
        self.active = 0
        self.queue: list[tuple[list[Any], asyncio.Future[Any]]] = []


# request-reply (replies.py): the reply of each key (base64, field ``rp``) if the owner still
# holds its CONSUMING claim. ARGV: now, then owner and reply per key.
_PUT_REPLIES = """
local now = tonumber(ARGV[1])
local out = {}
for i, k in ipairs(KEYS) do
  local r = redis.call('HMGET', k, 'st', 'own', 'ex')
  if r[1] == 'CONSUMING' and r[2] == ARGV[2 * i] and r[3] and tonumber(r[3]) > now then
    redis.call('HSET', k, 'rp', ARGV[2 * i + 1])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""


def _size(batch: Any) -> int:
    """Keys in a waiting batch: a list of claims or tickets, or a listener operation
    (``("claim" | "complete", group, items, ...)``)."""
    return len(batch[2]) if isinstance(batch, tuple) else len(batch)


def _check_field(value: str) -> None:
    if "\n" in value:  # the scripts' field separator
        raise ValueError(f"owner token or payload hash with a newline: {value!r}")


def _ttl_ms(expires_at: float, now: float) -> str:
    return str(max(1, math.ceil((expires_at - now) * 1000)))


class RedisStore:
    """A dedup store in Redis (``prefix`` keeps several users of one database apart)."""

    def __init__(self, url: str, *, clock: Clock = time.time, prefix: str = "onceq:dedup:",
                 timeout_s: float | str = 5.0) -> None:
        try:
            import redis.asyncio as aioredis
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise ImportError("the Redis dedup store needs redis: pip install "
                              "'onceq[idempotency]'") from exc
        import redis.exceptions
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff

        self.clock = clock
        self.prefix = prefix
        self._errors = (redis.exceptions.RedisError, OSError)
        self._redis = aioredis.from_url(url, socket_timeout=float(timeout_s),
                                        socket_connect_timeout=float(timeout_s),
                                        decode_responses=True,
                                        # a short retry: the consumer retries the batch
                                        retry=Retry(ExponentialBackoff(0.5, 0.05), 2))
        self._claim = self._redis.register_script(_CLAIM)
        self._cas_script = self._redis.register_script(_CAS)
        self._ops_script = self._redis.register_script(_OPS)
        self._put_replies_script = self._redis.register_script(_PUT_REPLIES)
        self._lanes: dict[tuple[Any, ...], _Lane] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _key(self, group: str, topic: str, key: str) -> str:
        return f"{self.prefix}{group}:{topic}:{key}"

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            return await script(keys=keys, args=args)
        except self._errors as exc:
            raise StoreError(f"redis dedup store: {type(exc).__name__}: {exc}") from exc

    async def claim_many(self, claims: Sequence[Claim]) -> list[ClaimResult]:
        if not claims:
            return []
        for c in claims:
            if len(c.key) > MAX_KEY_LEN:
                raise ValueError(f"dedup key longer than {MAX_KEY_LEN} characters")
            _check_field(c.owner)
            _check_field(c.payload_hash)
        return await self._merged(("claim",), list(claims), self._claim_group)

    # ------------------------------------------------------------------ the listener's path
    async def claim_keys(self, group: str, items: Sequence[KeyClaim], lease_s: float,
                         retention_s: float, check_payload: bool
                         ) -> tuple[float, dict[int, ClaimResult]]:
        """``store.claim_keys``: a listener batch's claims as tuples; the store's time and
        the results of the claims that found a record. It goes in one script call with
        the other batches' claims and completions waiting meanwhile (``_ops_group``)."""
        if not items:
            return self.clock(), {}
        for _, k, o, p in items:
            if len(k) > MAX_KEY_LEN:
                raise ValueError(f"dedup key longer than {MAX_KEY_LEN} characters")
            if "\n" in o or "\n" in p:
                _check_field(o)
                _check_field(p)
        return await self._merged(("ops",), ("claim", group, items, lease_s, retention_s,
                                             check_payload), self._ops_group)

    async def complete_keys(self, group: str, items: Sequence[KeyClaim], retention_s: float
                            ) -> list[bool]:
        """``store.complete_keys``: ``complete_many`` of a listener batch's claims, in the
        script call of the next claims (or on its own when none is waiting)."""
        if not items:
            return []
        for _, _, o, _ in items:
            _check_field(o)
        return await self._merged(("ops",), ("complete", group, items, retention_s),
                                  self._ops_group)

    async def _ops_group(self, ops: list[tuple[Any, ...]]
                         ) -> list[Any]:
        """Completions and claims of several listener batches in one script call
        (``_OPS``): the completions first, so that a copy of a message just finished is a
        duplicate rather than busy. The whole call is atomic, so each batch is."""
        now = self.clock()
        ckeys: list[str] = []
        cfields: list[str] = []
        keys: list[str] = []
        fields: list[str] = []
        key = self._key
        for op in ops:
            if op[0] == "complete":
                _, group, items, retention_s = op
                ex = now + retention_s
                tail = f"\n{ex!r}\n{_ttl_ms(ex, now)}\n"
                ckeys += [key(group, t, k) for t, k, _, _ in items]
                cfields += [o + tail for _, _, o, _ in items]
            else:
                _, group, items, lease_s, retention_s, check = op
                lease_until = now + lease_s
                expires_at = lease_until + retention_s
                tail = (f"\n{'1' if check else '0'}\n{lease_until!r}\n{expires_at!r}\n"
                        f"{_ttl_ms(expires_at, now)}\n")
                keys += [key(group, t, k) for t, k, _, _ in items]
                fields += [f"{o}\n{p}{tail}" for _, _, o, p in items]
        reply = await self._call(self._ops_script, ckeys + keys,
                                 [repr(now), f"{now:.3f}", str(len(ckeys)), "".join(cfields),
                                  "".join(fields)])
        done, fresh, found = reply[0], reply[1], iter(reply[2:])
        outs: list[Any] = []
        cpos = pos = 0
        for op in ops:
            n = len(op[2])
            if op[0] == "complete":
                flags = done[cpos:cpos + n]
                cpos += n
                outs.append([True] * n if "0" not in flags else [c == "1" for c in flags])
                continue
            flags = fresh[pos:pos + n]
            pos += n
            if "0" not in flags:  # every claim created its record: no object per message
                outs.append((now, {}))
                continue
            _, group, items, lease_s, retention_s, check = op
            odd: dict[int, ClaimResult] = {}
            error: BaseException | None = None
            for j, flag in enumerate(flags):
                if flag == "1":
                    continue
                t, k, o, p = items[j]
                outcome, *rec = next(found)
                res, _ = decide_claim(self._record(group, t, k, rec),
                                      Claim(group, t, k, o, p, lease_s, retention_s, check),
                                      now)
                if res.outcome is not _OUTCOMES.get(outcome) and error is None:
                    error = StoreError(f"redis dedup store: the script said {outcome} where "
                                       f"the rules say {res.outcome} for {k!r}")
                odd[j] = res
            outs.append((now, odd) if error is None else error)
        return outs

    async def _claim_group(self, batches: list[list[Claim]]
                           ) -> list[list[ClaimResult] | BaseException]:
        """The claims of several batches in one script call (each batch stays atomic:
        the whole call is)."""
        now = self.clock()
        fields: list[str] = []
        keys: list[str] = []
        for batch in batches:
            for c in batch:
                lease_until = now + c.lease_s
                expires_at = lease_until + c.retention_s
                fields += [c.owner, c.payload_hash, "1" if c.check_payload else "0",
                           repr(lease_until), repr(expires_at), _ttl_ms(expires_at, now)]
                keys.append(self._key(c.group, c.topic, c.key))
        replies = iter(await self._call(self._claim, keys,
                                        [repr(now), "\n".join(fields) + "\n", f"{now:.3f}"]))
        outs: list[list[ClaimResult] | BaseException] = []
        claimed = history_line(now, "claimed", 1, "")[:-1]  # + owner + newline
        for batch in batches:
            out: list[ClaimResult] = []
            error: BaseException | None = None
            for c in batch:
                reply = next(replies)
                if isinstance(reply, str):  # no record before: a fresh claim
                    lease_until = now + c.lease_s
                    out.append(ClaimResult(Outcome.CLAIMED, Record(
                        c.group, c.topic, c.key, Status.CONSUMING, c.owner, 1, lease_until,
                        c.payload_hash, now, now, lease_until + c.retention_s,
                        f"{claimed}{c.owner}\n")))
                    continue
                outcome, *rec = reply
                found = self._record(c.group, c.topic, c.key, rec)
                res, _ = decide_claim(found, c, now)
                if res.outcome is not _OUTCOMES.get(outcome) and error is None:
                    error = StoreError(f"redis dedup store: the script said {outcome} where "
                                       f"the rules say {res.outcome} for {c.key!r}")
                out.append(res)
            outs.append(out if error is None else error)
        return outs

    @staticmethod
    def _record(group: str, topic: str, key: str, f: Sequence[Any]) -> Record | None:
        if not f or f[0] is None:
            return None
        return Record(group, topic, key, Status(f[0]), f[1], int(f[2]), float(f[3]), f[4],
                      float(f[5]), float(f[6]), float(f[7]), f[8] or "" if len(f) > 8 else "")

    async def _cas(self, mode: str, tickets: Sequence[Ticket], lease_s: float = 0.0,
                   retention_s: float = 0.0) -> list[bool]:
        if not tickets:
            return []
        for t in tickets:
            _check_field(t.owner)
        return await self._merged((mode, lease_s, retention_s), list(tickets),
                                  lambda batches: self._cas_group(mode, lease_s, retention_s,
                                                                  batches))

    async def _cas_group(self, mode: str, lease_s: float, retention_s: float,
                         batches: list[list[Ticket]]) -> list[list[bool] | BaseException]:
        now = self.clock()
        lease_until = now + lease_s
        expires_at = (lease_until if mode == "extend" else now) + retention_s
        tickets = [t for batch in batches for t in batch]
        args = [repr(now), mode, repr(lease_until), repr(expires_at),
                _ttl_ms(expires_at, now), "".join([t.owner + "\n" for t in tickets]),
                f"{now:.3f}"]
        res = iter(await self._call(self._cas_script,
                                    [self._key(t.group, t.topic, t.key) for t in tickets], args))
        return [[bool(next(res)) for _ in batch] for batch in batches]

    async def _merged(self, kind: tuple[Any, ...], batch: list[Any],
                      run: Callable[[list[list[Any]]], Awaitable[list[Any]]]) -> Any:
        """Run ``batch`` through ``run`` together with the batches of the same kind that
        other callers submit meanwhile: at most ``_LANES`` script calls of a kind are in
        flight; batches that arrive while they are wait and then go in one call (one round
        trip, one script run for many listener batches). ``run`` returns, per batch, its
        result or the exception to raise to its caller."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        lane = self._lanes.setdefault(kind, _Lane())
        lane.queue.append((batch, fut))
        if lane.active < _LANES:
            lane.active += 1
            task = loop.create_task(self._drain(lane, run))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await fut

    async def _drain(self, lane: _Lane,
                     run: Callable[[list[list[Any]]], Awaitable[list[Any]]]) -> None:
        take: list[tuple[list[Any], asyncio.Future[Any]]] = []
        try:
            while lane.queue:
                take, n = [], 0
                while lane.queue and (not take or n + _size(lane.queue[0][0]) <= _MERGE_MAX):
                    item = lane.queue.pop(0)
                    if item[1].done():  # its caller gave up (cancelled): not sent
                        continue
                    take.append(item)
                    n += _size(item[0])
                if not take:
                    continue
                try:
                    results = await run([b for b, _ in take])
                except Exception as exc:  # the call failed: every batch in it fails
                    results = [exc] * len(take)
                for (_, fut), res in zip(take, results, strict=True):
                    if fut.done():
                        continue
                    if isinstance(res, BaseException):
                        fut.set_exception(res)
                    else:
                        fut.set_result(res)
                take = []
        finally:
            lane.active -= 1
            for _, fut in take:  # cancelled meanwhile (the loop is closing): nobody waits
                if not fut.done():
                    fut.set_exception(StoreError("redis dedup store: call cancelled"))

    async def complete_many(self, tickets: Sequence[Ticket], retention_s: float) -> list[bool]:
        return await self._cas("complete", tickets, retention_s=retention_s)

    async def release_many(self, tickets: Sequence[Ticket]) -> list[bool]:
        return await self._cas("release", tickets)

    async def extend_many(self, tickets: Sequence[Ticket], lease_s: float,
                          retention_s: float) -> list[bool]:
        return await self._cas("extend", tickets, lease_s, retention_s)

    async def get(self, group: str, topic: str, key: str) -> Record | None:
        try:
            f = await self._redis.hmget(self._key(group, topic, key), _FIELDS)
        except self._errors as exc:
            raise StoreError(f"redis dedup store: {type(exc).__name__}: {exc}") from exc
        rec = self._record(group, topic, key, f)
        return rec if rec is not None and rec.alive(self.clock()) else None

    async def put_replies(self, group: str, items: Sequence[tuple[str, str, str, bytes]]
                          ) -> list[bool]:
        """``replies.put_replies``: one script call for the batch."""
        if not items:
            return []
        args: list[Any] = [repr(self.clock())]
        for _, _, owner, reply in items:
            args += [owner, base64.b64encode(reply).decode()]
        out = await self._call(self._put_replies_script,
                               [self._key(group, t, k) for t, k, _, _ in items], args)
        return [bool(int(x)) for x in out]

    async def get_replies(self, group: str, keys: Sequence[tuple[str, str]]
                          ) -> list[bytes | None]:
        """``replies.get_replies``: the reply field of each ``CONSUMED`` record."""
        if not keys:
            return []
        now = self.clock()
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for t, k in keys:
                    pipe.hmget(self._key(group, t, k), ["st", "ex", "rp"])
                rows = await pipe.execute()
        except self._errors as exc:
            raise StoreError(f"redis dedup store: {type(exc).__name__}: {exc}") from exc
        return [base64.b64decode(rp) if st == Status.CONSUMED.value and rp is not None
                and ex is not None and float(ex) > now else None for st, ex, rp in rows]

    async def purge_expired(self, limit: int = 1000, updated_before: float = 0.0) -> int:
        """Redis removes records itself when their TTL ends; records whose expiry passed on
        the store clock but not on the server's are removed here (bounded by ``limit``)."""
        now = self.clock()
        dead = []
        try:
            async for k in self._redis.scan_iter(match=self._pattern(), count=500):
                ex, ua = await self._redis.hmget(k, ["ex", "ua"])
                if ex is not None and (float(ex) <= now or float(ua or 0) < updated_before):
                    dead.append(k)
                    if len(dead) >= limit:
                        break
            if dead:
                await self._redis.delete(*dead)
        except self._errors as exc:
            raise StoreError(f"redis dedup store: {type(exc).__name__}: {exc}") from exc
        return len(dead)

    def _pattern(self) -> str:
        return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in self.prefix) + "*"

    async def stats(self) -> StoreStats:
        now = self.clock()
        counts = dict.fromkeys(Status, 0)
        try:
            async for k in self._redis.scan_iter(match=self._pattern(), count=500):
                st, ex = await self._redis.hmget(k, ["st", "ex"])
                if st is not None and ex is not None and float(ex) > now:
                    counts[Status(st)] += 1
        except self._errors as exc:
            raise StoreError(f"redis dedup store: {type(exc).__name__}: {exc}") from exc
        return StoreStats(*counts.values())

    async def drop_all(self) -> None:
        """Delete every record under this store's prefix (tests and the operator's reset)."""
        keys = [k async for k in self._redis.scan_iter(match=self._pattern(), count=500)]
        for i in range(0, len(keys), 500):
            await self._redis.delete(*keys[i:i + 500])

    async def close(self) -> None:
        await self._redis.aclose()
