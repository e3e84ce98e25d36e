"""Distributed rate limiting in Redis: requests, token reservations and stream slots, atomically.

One Lua script admits a request: it refills the tenant's request bucket and token bucket from the
time elapsed (Redis ``TIME``, so gateway clocks do not matter), drops expired stream leases, checks
all three limits, and only if every one passes takes one request, reserves ``prompt + max_tokens``
tokens and adds a stream lease. Redis runs scripts one at a time, so the result is exact across any
number of gateway replicas. A second script settles: it gives back ``reserved - used`` tokens (or
takes the excess when the estimate was low) and removes the stream lease.

Stream leases expire at the request's deadline (plus a margin): a gateway that crashes mid-stream
leaks its slots only until then, with no heartbeat needed.

Redis unreachable: after one failed call the limiter stops calling Redis for ``retry_after_s``
(so an outage costs one timeout, not one per request) and follows ``failure_mode``: ``open`` admits
without limits, ``closed`` rejects with UNAVAILABLE. It tries Redis again after that pause, so it
recovers on its own. Written here rather than taken from a library: the Python limiters on PyPI
do not reserve-and-settle, nor tie three limits into one atomic step.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import structlog
from prometheus_client import Counter
from redis.exceptions import RedisError

from services.common.errors import ResourceExhausted, Unavailable
from services.gateway.policy import TenantPolicy
from services.store.connection import AnyRedis
from services.store.gateway_keys import rate_limit_keys
from services.store.pipelined import PipelinedRedis

log = structlog.get_logger(__name__)

FailureMode = Literal["open", "closed"]

RATE_LIMIT_REJECTIONS = Counter(
    "meshserve_rate_limit_rejections_total",
    "Requests the gateway rejected for a tenant limit, by reason (requests, tokens, streams).",
    ["service", "tenant", "reason"],
)
RATE_LIMIT_DEGRADED = Counter(
    "meshserve_rate_limit_degraded_total",
    "Admission decisions taken without Redis (it was unreachable), by failure mode.",
    ["service", "mode"],
)

# KEYS: req bucket, token bucket, stream zset.
# ARGV: rpm, burst, tpm, tokens to reserve, count a request (0/1), max streams, lease id, lease ttl ms.
# Returns {1, "ok", 0} or {0, reason, retry_after_ms}.
ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, burst, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local need, count, max_streams = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local lease, ttl = ARGV[7], tonumber(ARGV[8])

local function level(key, cap, per_min)
  local v = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens, ts = tonumber(v[1]), tonumber(v[2])
  if tokens == nil or ts == nil then return cap end
  return math.min(cap, tokens + math.max(0, now - ts) * per_min / 60000)
end

local req, tok = 0, 0
if count == 1 and rpm > 0 then
  req = level(KEYS[1], burst, rpm)
  if req < 1 then return {0, 'requests', math.ceil((1 - req) * 60000 / rpm)} end
end
if need > 0 and tpm > 0 then
  tok = level(KEYS[2], tpm, tpm)
  if tok < need then return {0, 'tokens', math.ceil((need - tok) * 60000 / tpm)} end
end
if lease ~= '' and max_streams > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= max_streams then
    local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    return {0, 'streams', math.min(1000, math.max(1, tonumber(first[2]) - now))}
  end
end

if count == 1 and rpm > 0 then
  redis.call('HSET', KEYS[1], 'tokens', tostring(req - 1), 'ts', now)
  redis.call('PEXPIRE', KEYS[1], math.ceil(burst * 60000 / rpm) + 1000)
end
if need > 0 and tpm > 0 then
  local left = tok - need
  redis.call('HSET', KEYS[2], 'tokens', tostring(left), 'ts', now)
  redis.call('PEXPIRE', KEYS[2], math.ceil((tpm - left) * 60000 / tpm) + 1000)
end
if lease ~= '' and max_streams > 0 then
  redis.call('ZADD', KEYS[3], now + ttl, lease)
  if redis.call('PTTL', KEYS[3]) < ttl + 1000 then redis.call('PEXPIRE', KEYS[3], ttl + 1000) end
end
return {1, 'ok', 0}
"""

# KEYS: token bucket, stream zset. ARGV: tpm, tokens to give back (negative takes more), lease id.
SETTLE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local tpm, refund, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
if tpm > 0 and refund ~= 0 then
  local v = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  local tokens, ts = tonumber(v[1]), tonumber(v[2])
  local cur = tpm
  if tokens ~= nil and ts ~= nil then cur = math.min(tpm, tokens + math.max(0, now - ts) * tpm / 60000) end
  local left = math.min(tpm, cur + refund)
  redis.call('HSET', KEYS[1], 'tokens', tostring(left), 'ts', now)
  redis.call('PEXPIRE', KEYS[1], math.ceil((tpm - left) * 60000 / tpm) + 1000)
end
if lease ~= '' then redis.call('ZREM', KEYS[2], lease) end
return 1
"""

_REASONS = {
    "requests": "rate limit: too many requests per minute for tenant {tenant}; retry after the retry-after-ms delay",
    "tokens": "rate limit: tenant {tenant} is out of tokens for this minute; retry after the retry-after-ms delay",
    "streams": "rate limit: tenant {tenant} has its maximum number of concurrent streams open; close one or retry",
}


@dataclass(frozen=True)
class Reservation:
    """What one admission took; hand it back to :meth:`RateLimiter.settle` when the request ends."""

    tenant: str
    tokens: int
    tokens_per_minute: int
    lease: str = ""
    degraded: bool = False
    """True when admitted without Redis (fail-open): settling it is a no-op."""


class RateLimiter:
    """Admission and settlement against Redis; see the module docstring for the algorithm."""

    def __init__(
        self,
        client: AnyRedis,
        *,
        failure_mode: FailureMode = "open",
        retry_after_s: float = 1.0,
        lease_margin_s: float = 5.0,
        pipelined: PipelinedRedis | None = None,
    ) -> None:
        """``pipelined``, if given, runs the admit and settle scripts (the hot path) over one pipelined
        connection (services/store/pipelined.py); ``client`` serves the rest."""
        self._client = client
        self._pipelined = pipelined
        self._admit: Any = client.register_script(ADMIT_LUA) if pipelined is None else pipelined.script(ADMIT_LUA)
        self._settle: Any = client.register_script(SETTLE_LUA) if pipelined is None else pipelined.script(SETTLE_LUA)
        self.failure_mode = failure_mode
        self._retry_after_s = retry_after_s
        self._lease_margin_s = lease_margin_s
        self._down_until = 0.0
        self._down = False

    async def admit(
        self,
        tenant: str,
        policy: TenantPolicy,
        *,
        tokens: int,
        count_request: bool = True,
        stream_ttl_s: float | None = None,
    ) -> Reservation:
        """Take one request (if ``count_request``), reserve ``tokens`` and, with ``stream_ttl_s``, a
        stream slot leased for that long. Raises ResourceExhausted (with retry-after) on a limit,
        Unavailable when Redis is down and the mode is ``closed``."""
        lease = uuid.uuid4().hex if stream_ttl_s is not None and policy.max_concurrent_streams else ""
        ttl_ms = int(((stream_ttl_s or 0.0) + self._lease_margin_s) * 1000)
        if time.monotonic() < self._down_until:
            return self._degraded(tenant, policy)
        try:
            allowed, reason, retry_ms = await self._admit(
                keys=rate_limit_keys(tenant).as_list(),
                args=[
                    policy.requests_per_minute,
                    policy.burst,
                    policy.tokens_per_minute,
                    max(0, tokens),
                    1 if count_request else 0,
                    policy.max_concurrent_streams,
                    lease,
                    ttl_ms,
                ],
            )
        except (RedisError, OSError) as exc:
            await self._mark_down(exc)
            return self._degraded(tenant, policy)
        self._mark_up()
        if not int(allowed):
            why = reason.decode() if isinstance(reason, bytes) else str(reason)
            RATE_LIMIT_REJECTIONS.labels("gateway", tenant, why).inc()
            log.info("rate_limited", reason=why, retry_after_ms=int(retry_ms))
            raise ResourceExhausted(_REASONS.get(why, _REASONS["requests"]).format(tenant=tenant), int(retry_ms))
        return Reservation(tenant, max(0, tokens), policy.tokens_per_minute, lease)

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """Give back what ``reservation`` took beyond ``used_tokens`` and free its stream slot.

        Never raises: with Redis down the refund is lost (the bucket refills anyway) and the
        lease expires at its deadline.
        """
        if reservation.degraded:
            return
        refund = reservation.tokens - max(0, used_tokens) if reservation.tokens_per_minute else 0
        if refund == 0 and not reservation.lease:
            return
        keys = rate_limit_keys(reservation.tenant)
        try:
            await self._settle(
                keys=[keys.tokens, keys.streams], args=[reservation.tokens_per_minute, refund, reservation.lease]
            )
        except (RedisError, OSError) as exc:
            await self._mark_down(exc)
            log.warning("rate_limit_settle_failed", error=type(exc).__name__, refund=refund)

    async def tokens_available(self, tenant: str, policy: TenantPolicy) -> float:
        """The tenant's token-bucket level now (for tests and admin tools)."""
        raw = await self._client.hmget(rate_limit_keys(tenant).tokens, ["tokens", "ts"])
        if raw[0] is None or raw[1] is None:
            return float(policy.tokens_per_minute)
        seconds, micros = await self._client.time()
        now_ms = seconds * 1000 + micros // 1000
        level = float(raw[0]) + max(0, now_ms - int(raw[1])) * policy.tokens_per_minute / 60000
        return min(float(policy.tokens_per_minute), level)

    async def open_streams(self, tenant: str) -> int:
        """Stream leases currently held by ``tenant`` (expired ones included until next admission)."""
        return int(await self._client.zcard(rate_limit_keys(tenant).streams))

    def _degraded(self, tenant: str, policy: TenantPolicy) -> Reservation:
        RATE_LIMIT_DEGRADED.labels("gateway", self.failure_mode).inc()
        if self.failure_mode == "closed":
            raise Unavailable("the rate limiter cannot reach its store right now; retry in a few seconds")
        return Reservation(tenant, 0, policy.tokens_per_minute, degraded=True)

    async def _mark_down(self, exc: BaseException) -> None:
        self._down_until = time.monotonic() + self._retry_after_s
        if not self._down:
            self._down = True
            log.warning("rate_limiter_redis_down", error=type(exc).__name__, mode=self.failure_mode)
            # Idle pooled connections opened before the outage are dead too; drop them so the first
            # calls after Redis returns do not fail one by one on stale sockets. Not the ones in use:
            # redis-py fails a command whose socket is closed under it with an AttributeError.
            pool = getattr(self._client, "connection_pool", None)  # a Cluster client re-maps its nodes itself
            if pool is not None:
                with contextlib.suppress(RedisError, OSError):
                    await pool.disconnect(inuse_connections=False)
            if self._pipelined is not None:
                self._pipelined.disconnect()

    def _mark_up(self) -> None:
        if self._down:
            self._down = False
            log.info("rate_limiter_redis_recovered")

    async def close(self) -> None:
        if self._pipelined is not None:
            await self._pipelined.aclose()
        await self._client.aclose()
