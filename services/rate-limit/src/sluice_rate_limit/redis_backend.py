"""The Redis backend: several rate-limit replicas enforce one global limit.

Each decision is ONE round trip: an atomic Lua script (EVALSHA) that sweeps expired leases,
reads every budget of the request, and either charges all of them and records the lease, or
charges none. Time comes from Redis (`TIME`), not from the replica, so replicas with skewed
clocks still agree on the window. The decisions of one event-loop turn share that round trip
(script_pipeline.py).

Keys are hash-tagged by model: `<prefix>:{<model>}:...` (`{`, `}` and `%` of the name
percent-encoded). Every key one decision touches (the tenant's budgets for that model, the model's
global capacity, the lease table) then lives in one Redis Cluster slot, which is what lets one
script check them all atomically; a cluster spreads models across shards. Layout under `<prefix>:{<model>}`:

    :w:<budget key>   sorted set, one sliding window's log: entry (lease id|i or |b) by time (ms)
    :a:<budget key>   hash, that window's amounts: entry -> tokens or requests, "_t" total, "_i" interactive
    :g                hash, every in-flight gauge of the model: "<budget key>" and "<budget key>:i"
    :l                hash, lease id -> JSON of what it charged (to refund and free it)
    :x                sorted set, lease id by expiry time (ms)

The script implements the same rule as sliding_window.py; the unit tests run one suite against
both backends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.connection import HiredisRespSerializer
from redis.utils import HIREDIS_AVAILABLE

from sluice_common.request_context import new_unique_id

from sluice_rate_limit.budgets import BUDGET_NAMES, MAX_AMOUNT, Budget, BudgetState, Check, Decision, Kind, LeaseNotFound
from sluice_rate_limit.memory_backend import GAUGE_RETRY_S
from sluice_rate_limit.script_pipeline import ScriptPipeline

# Expired leases one script frees (its sweep) before it reads the in-flight gauges. Every acquire
# grants at most one lease, so a call usually finds about one to free; a backlog (a model idle while
# many leases lapsed, a gateway gone with its calls in flight) is freed this many a call, about 15 us
# each (~15 ms a full batch on a laptop), so that no call holds Redis, and every replica's decisions
# behind it, for long. Leases beyond it count in flight until a later call frees them (denials, never
# over-admission); a settle or a renew finds them expired all the same.
SWEEP_MAX = 1024

_COMMON = r"""
local leases, expiry, gauges = KEYS[1], KEYS[2], KEYS[3]
local window = tonumber(ARGV[1])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000

local function sub(field, amount)
  local left = redis.call('HINCRBY', gauges, field, -amount)
  if left < 0 then redis.call('HSET', gauges, field, 0) end
end

local function free_gauges(lease)
  for _, e in ipairs(lease.e) do
    if e.k == 'g' then
      sub(e.f, e.c)
      if lease.i == 1 then sub(e.f .. ':i', e.c) end
    end
  end
end

-- frees the expired leases, at most a bounded batch of them a call (the constant above this script)
local function sweep()
  local ids = redis.call('ZRANGEBYSCORE', expiry, '-inf', now, 'LIMIT', 0, SWEEP_MAX)
  for _, id in ipairs(ids) do
    local raw = redis.call('HGET', leases, id)
    if raw then
      free_gauges(cjson.decode(raw))
      redis.call('HDEL', leases, id)
    end
    redis.call('ZREM', expiry, id)
  end
  return #ids
end

-- drops the entries admitted window ms ago or earlier from the log z and the totals in hash a
local function trim(z, a)
  while true do
    local old = redis.call('ZRANGEBYSCORE', z, '-inf', now - window, 'LIMIT', 0, 500)
    if #old == 0 then return end
    local amounts = redis.call('HMGET', a, unpack(old))
    local total, inter = 0, 0
    for j, id in ipairs(old) do
      local v = tonumber(amounts[j] or 0)
      total = total + v
      if string.sub(id, -2) == '|i' then inter = inter + v end
    end
    redis.call('HDEL', a, unpack(old))
    redis.call('ZREM', z, unpack(old))
    if total ~= 0 then redis.call('HINCRBY', a, '_t', -total) end
    if inter ~= 0 then redis.call('HINCRBY', a, '_i', -inter) end
    if #old < 500 then return end
  end
end

local function window_read(z, a)
  trim(z, a)
  local v = redis.call('HMGET', a, '_t', '_i')
  return tonumber(v[1] or 0), tonumber(v[2] or 0)
end

-- tat: the window's pace (see pace), which its keys outlive as they outlive its log's entries
local function window_add(z, a, member, amount, interactive, tat)
  redis.call('ZADD', z, now, member)
  redis.call('HINCRBY', a, member, amount)
  redis.call('HINCRBY', a, '_t', amount)
  if interactive == 1 then redis.call('HINCRBY', a, '_i', amount) end
  local ttl = math.ceil(math.max(window + 1000, tat - now + window))
  redis.call('PEXPIRE', z, ttl)
  redis.call('PEXPIRE', a, ttl)
end

-- ms until the admission rule takes `cost` (0: it does now), walking the log oldest first with
-- both totals: for bulk, an interactive entry that leaves gives the floor's reserve back what it covered
local function retry_walk(z, a, used, iused, cost, limit, floor, interactive)
  local room = limit - cost
  local function fits()
    if interactive == 1 then return used <= room end
    return used + math.max(0, floor - iused) <= room
  end
  if fits() then return 0 end
  local offset = 0
  while true do
    local page = redis.call('ZRANGE', z, offset, offset + 63, 'WITHSCORES')
    if #page == 0 then return window end
    local members = {}
    for j = 1, #page, 2 do members[#members + 1] = page[j] end
    local amounts = redis.call('HMGET', a, unpack(members))
    for j = 1, #members do
      local v = tonumber(amounts[j] or 0)
      used = used - v
      if string.sub(members[j], -2) == '|i' then iused = iused - v end
      if fits() then return math.max(0, tonumber(page[2 * j]) + window - now) end
    end
    offset = offset + 64
  end
end

local function reset_of(z)
  local last = redis.call('ZRANGE', z, -1, -1, 'WITHSCORES')
  if #last == 0 then return 0 end
  return math.max(0, tonumber(last[2]) + window - now)
end

local function state(kind, z, a)
  if kind == 'w' then
    local total = window_read(z, a)
    return total, reset_of(z)
  end
  return tonumber(redis.call('HGET', gauges, z) or '0'), 0
end

-- GCRA pace of a window (see sliding_window.py); its theoretical arrival time is field _p of a
local function paced(limit, burst) return burst > 0 and burst < limit end

local function pace_wait(a, limit, burst, cost, floor, interactive)
  if not paced(limit, burst) then return 0 end
  local interval = window / limit
  local debt = math.max(tonumber(redis.call('HGET', a, '_p') or '0'), now) - now
  local tolerance = math.max(0, (burst - cost) * interval)
  if interactive == 1 then tolerance = tolerance + floor * interval end
  local wait = debt - tolerance
  if wait <= 0.000001 then return 0 end
  return wait
end

-- Charges (amount > 0; one charge owes at most a whole limit's worth, one window) or refunds the
-- pace; returns its theoretical arrival time (0: not paced), for window_add's TTL. A refund finds
-- nothing to give back once the hash has expired with its debt, and creates no key without a TTL.
local function pace(a, limit, burst, amount)
  if not paced(limit, burst) then return 0 end
  local tat = redis.call('HGET', a, '_p')
  if amount > 0 then
    tat = math.max(tonumber(tat or '0'), now) + math.min(amount, limit) * window / limit
  elseif tat then
    tat = tonumber(tat) + amount * window / limit
  else
    return 0
  end
  redis.call('HSET', a, '_p', tostring(tat))
  return tat
end

local function member(lease_id, interactive)
  if interactive == 1 then return lease_id .. '|i' end
  return lease_id .. '|b'
end
""".replace("SWEEP_MAX", str(SWEEP_MAX))

# ARGV: window_ms, interactive, ttl_ms, lease_id, gauge_retry_ms, count, then per check kind,
# log key (windows) or gauge field, totals key (windows), limit, cost, floor, refundable, budget, burst.
# Returns allowed, denied index, retry ms, expiry ms, expired leases, then per check used, reset ms.
ACQUIRE = (
    _COMMON
    + r"""
local interactive, ttl, lease_id = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local gauge_retry, count = tonumber(ARGV[5]), tonumber(ARGV[6])
local expired = sweep()
local checks, denied, retry = {}, 0, 0
for j = 1, count do
  local b = 7 + (j - 1) * 9
  local c = {k = ARGV[b], f = ARGV[b + 1], a = ARGV[b + 2], l = tonumber(ARGV[b + 3]), c = tonumber(ARGV[b + 4]),
             fl = tonumber(ARGV[b + 5]), r = tonumber(ARGV[b + 6]), b = tonumber(ARGV[b + 7]), bu = tonumber(ARGV[b + 8])}
  local used, iused, pw = 0, 0, 0
  if c.k == 'w' then
    used, iused = window_read(c.f, c.a)
    pw = pace_wait(c.a, c.l, c.bu, c.c, c.fl, interactive)
  else
    used = tonumber(redis.call('HGET', gauges, c.f) or '0')
    iused = tonumber(redis.call('HGET', gauges, c.f .. ':i') or '0')
  end
  c.used = used
  local reserve = 0
  if interactive == 0 then reserve = math.max(0, c.fl - iused) end
  if pw > 0 or used + c.c + reserve > c.l then
    local wait = gauge_retry
    if c.k == 'w' then wait = math.max(pw, retry_walk(c.f, c.a, used, iused, c.c, c.l, c.fl, interactive)) end
    if denied == 0 or wait > retry then denied, retry = j, wait end
  end
  checks[j] = c
end
local out = {0, denied, math.ceil(retry), 0, expired}
if denied == 0 then
  local entries = {}
  for j, c in ipairs(checks) do
    if c.k == 'w' then
      window_add(c.f, c.a, member(lease_id, interactive), c.c, interactive, pace(c.a, c.l, c.bu, c.c))
    else
      redis.call('HINCRBY', gauges, c.f, c.c)
      if interactive == 1 then redis.call('HINCRBY', gauges, c.f .. ':i', c.c) end
    end
    c.used = c.used + c.c
    entries[j] = {k = c.k, f = c.f, a = c.a, c = c.c, r = c.r, l = c.l, b = c.b, bu = c.bu}
  end
  local expires = now + ttl
  redis.call('HSET', leases, lease_id, cjson.encode({i = interactive, e = entries}))
  redis.call('ZADD', expiry, expires, lease_id)
  out[1] = 1
  out[4] = math.floor(expires)
end
for _, c in ipairs(checks) do
  out[#out + 1] = c.used
  if c.k == 'w' then out[#out + 1] = math.ceil(reset_of(c.f)) else out[#out + 1] = 0 end
end
return out
"""
)

# ARGV: window_ms, lease_id, used tokens (-1: release, refund everything). Returns found, then per
# entry of the lease budget, limit, used, reset ms: any replica can settle any lease.
SETTLE = (
    _COMMON
    + r"""
local lease_id, used = ARGV[2], tonumber(ARGV[3])
-- checked before the first write: a script that fails half way keeps what it wrote
if not used or used ~= math.floor(used) or used < -1 or used > MAX_AMOUNT then
  return redis.error_reply('ERR used tokens must be an integer in [-1, 2^53], got ' .. ARGV[3])
end
sweep()
local raw = redis.call('HGET', leases, lease_id)
if not raw then return {0} end
local at = redis.call('ZSCORE', expiry, lease_id)
redis.call('HDEL', leases, lease_id)
redis.call('ZREM', expiry, lease_id)
local lease = cjson.decode(raw)
free_gauges(lease)
-- past its expiry but beyond this sweep's batch: expired, freed as the sweep would have
if at and tonumber(at) <= now then return {0} end
local mine = member(lease_id, lease.i)
for _, e in ipairs(lease.e) do
  if e.k == 'w' and e.r == 1 then
    trim(e.f, e.a)
    local delta = e.c - math.max(used, 0)
    if delta > 0 then
      local give = math.min(delta, tonumber(redis.call('HGET', e.a, mine) or '0'))
      if give > 0 then
        redis.call('HINCRBY', e.a, mine, -give)
        redis.call('HINCRBY', e.a, '_t', -give)
        if lease.i == 1 then redis.call('HINCRBY', e.a, '_i', -give) end
      end
      pace(e.a, e.l, e.bu or 0, -delta)
    elseif delta < 0 then
      window_add(e.f, e.a, member(lease_id .. '+', lease.i), -delta, lease.i, pace(e.a, e.l, e.bu or 0, -delta))
    end
  end
end
local out = {1}
for _, e in ipairs(lease.e) do
  local u, r = state(e.k, e.f, e.a)
  out[#out + 1] = e.b
  out[#out + 1] = e.l
  out[#out + 1] = u
  out[#out + 1] = math.ceil(r)
end
return out
""".replace("MAX_AMOUNT", str(MAX_AMOUNT))
)

# ARGV: window_ms, lease_id, ttl ms. Returns the new expiry ms (0: no such live lease), expired leases.
RENEW = (
    _COMMON
    + r"""
local lease_id, ttl = ARGV[2], tonumber(ARGV[3])
local expired = sweep()
local at = redis.call('ZSCORE', expiry, lease_id)
-- past its expiry but beyond this sweep's batch: as good as expired, left to a later sweep
if not at or tonumber(at) <= now then return {0, expired} end
local expires = now + ttl
redis.call('ZADD', expiry, expires, lease_id)
return {math.floor(expires), expired}
"""
)

# ARGV: window_ms, then triples kind, log key or gauge field, totals key. Returns per check used, reset ms.
PEEK = (
    _COMMON
    + r"""
sweep()
local out = {}
for a = 2, #ARGV, 3 do
  local u, r = state(ARGV[a], ARGV[a + 1], ARGV[a + 2])
  out[#out + 1] = u
  out[#out + 1] = math.ceil(r)
end
return out
"""
)


class _HiredisPacking:
    """Packs commands with hiredis (C) instead of redis-py's asyncio connection's Python packer,
    which costs about 1 us per argument: an Acquire's script call has 67, twice the rest of the
    backend's Python per decision. redis-py's sync connection already packs with hiredis; the
    bytes are the same."""

    _packer = HiredisRespSerializer()

    def pack_command(self, *args: Any) -> list[bytes]:
        return self._packer.pack(*args)


def _with_hiredis_packing(client: aioredis.Redis) -> None:
    """The client's connections (TCP, TLS or unix socket, whichever its URL chose) pack with hiredis."""
    pool = client.connection_pool
    if HIREDIS_AVAILABLE and not issubclass(pool.connection_class, _HiredisPacking):
        base = pool.connection_class
        pool.connection_class = type(f"Hiredis{base.__name__}", (_HiredisPacking, base), {})


_BUDGETS = {int(budget): budget for budget in Budget}


_TAG_ESCAPES = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D"})


def _tag(model: str) -> str:
    """The model as its keys' hash tag, one tag per model: `{` and `}` (which would end the tag)
    and `%` percent-encoded, every other name as it is (the keys it always had). No model: "%",
    which no model's tag is."""
    return model.translate(_TAG_ESCAPES) or "%"


class RedisBackend:
    name = "redis"

    def __init__(
        self,
        url: str,
        prefix: str,
        window_s: float,
        timeout_s: float = 0.1,
        on_expired: Callable[[int], None] | None = None,
    ) -> None:
        self.on_expired = on_expired
        self.window_s = window_s
        self._window_ms = window_s * 1000.0
        self._prefix = prefix
        self.client = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
            health_check_interval=0,
        )
        _with_hiredis_packing(self.client)
        self._acquire = self.client.register_script(ACQUIRE)
        self._settle = self.client.register_script(SETTLE)
        self._peek = self.client.register_script(PEEK)
        self._renew = self.client.register_script(RENEW)
        self._scripts = ScriptPipeline(self.client)
        # Per tag: the keys of its lease tables, and each budget key's (log or gauge field, totals
        # key), formatted once instead of twice per budget of every decision.
        self._names: dict[str, tuple[list[str], dict[str, tuple[str, str]]]] = {}

    def _base(self, tag: str) -> str:
        return f"{self._prefix}:{{{_tag(tag)}}}"

    def _names_of(self, tag: str) -> tuple[list[str], dict[str, tuple[str, str]]]:
        names = self._names.get(tag)
        if names is None:
            if len(self._names) > 10_000:  # tags are models: a bound against a caller inventing them
                self._names.clear()
            base = self._base(tag)
            names = self._names[tag] = ([f"{base}:l", f"{base}:x", f"{base}:g"], {})
        return names

    def _fields(self, tag: str, fields: dict[str, tuple[str, str]], check: Check) -> tuple[str, str]:
        found = fields.get(check.key)
        if found is None:
            if len(fields) > 100_000:  # budget keys name tenants: bounded like Limits' plans
                fields.clear()
            base = self._base(tag)
            found = fields[check.key] = (f"{base}:w:{check.key}", f"{base}:a:{check.key}") if check.kind is Kind.WINDOW else (check.key, "")
        return found

    @staticmethod
    def new_lease_id(tag: str) -> str:
        return f"{new_unique_id()}.{tag}"

    async def acquire(self, checks: list[Check], interactive: bool, ttl_s: float, shadow: bool, tag: str = "", lease_id: str = "") -> Decision:
        """`lease_id`: the caller's (new_lease_id), to settle the lease by should it lose the reply."""
        lease_keys, fields = self._names_of(tag)
        lease_id = lease_id or self.new_lease_id(tag)
        args: list[object] = [
            self._window_ms,
            int(interactive),
            int(ttl_s * 1000),
            lease_id,
            int(GAUGE_RETRY_S * 1000),
            len(checks),
        ]
        window_keys = []
        for check in checks:
            log_key, totals_key = self._fields(tag, fields, check)
            if totals_key:
                window_keys += [log_key, totals_key]
            args += [
                check.kind.value,
                log_key,
                totals_key,
                check.limit,
                check.cost,
                check.floor,
                int(check.refundable),
                int(check.budget),
                check.burst,
            ]
        reply = await self._scripts.call(self._acquire, [*lease_keys, *window_keys], args)
        allowed, denied_index, retry_ms, expires_ms, expired = int(reply[0]), int(reply[1]), int(reply[2]), int(reply[3]), int(reply[4])
        if expired and self.on_expired is not None:
            self.on_expired(expired)
        states = [
            BudgetState(c.budget, c.limit, max(0, c.limit - int(reply[5 + 2 * i])), int(reply[6 + 2 * i]) / 1000.0, c.name)
            for i, c in enumerate(checks)
        ]
        if not allowed:
            denied = checks[denied_index - 1]
            return Decision(
                allowed=False,
                states=states,
                denied_by=denied.budget,
                denied_name=denied.name,
                retry_after_s=retry_ms / 1000.0,
                shadow=shadow,
            )
        return Decision(allowed=True, lease_id=lease_id, lease_expires_at=expires_ms / 1000.0, states=states)

    async def settle(self, lease_id: str, used_tokens: int | None) -> list[BudgetState]:
        _hex, _, tag = lease_id.partition(".")
        args: list[object] = [self._window_ms, lease_id, -1 if used_tokens is None else used_tokens]
        reply = await self._scripts.call(self._settle, self._names_of(tag)[0], args)
        if not int(reply[0]):
            raise LeaseNotFound(lease_id)
        states = []
        for i in range(1, len(reply), 4):
            budget = _BUDGETS[int(reply[i])]  # a dict, not Budget(n): the enum's lookup costs more than the rest
            limit = int(reply[i + 1])
            states.append(BudgetState(budget, limit, max(0, limit - int(reply[i + 2])), int(reply[i + 3]) / 1000.0, BUDGET_NAMES[budget]))
        return states

    async def renew(self, lease_id: str, ttl_s: float) -> float:
        """A live lease's new expiry, `ttl_s` from now by Redis's clock (LeaseNotFound once settled or expired)."""
        _hex, _, tag = lease_id.partition(".")
        reply = await self._renew(keys=self._names_of(tag)[0], args=[self._window_ms, lease_id, int(ttl_s * 1000)])
        expires_ms, expired = int(reply[0]), int(reply[1])
        if expired and self.on_expired is not None:
            self.on_expired(expired)
        if not expires_ms:
            raise LeaseNotFound(lease_id)
        return expires_ms / 1000.0

    async def peek(self, checks: list[Check], tag: str = "") -> list[BudgetState]:
        lease_keys, fields = self._names_of(tag)
        args: list[object] = [self._window_ms]
        for check in checks:
            args += [check.kind.value, *self._fields(tag, fields, check)]
        reply = await self._peek(keys=lease_keys, args=args)
        return [
            BudgetState(c.budget, c.limit, max(0, c.limit - int(reply[2 * i])), int(reply[1 + 2 * i]) / 1000.0, c.name) for i, c in enumerate(checks)
        ]

    def owns(self, lease_id: str) -> bool:
        return not lease_id.startswith("local-")

    async def close(self) -> None:
        await self._scripts.close()
        await self.client.aclose()
