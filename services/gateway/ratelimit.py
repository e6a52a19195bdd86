"""Per-API-key rate limits (requests and tokens per minute) as token buckets in Redis, so
that every gateway sharing the Redis shares the limits.

A client is its bearer token (hashed: the key never reaches Redis), else its address.
Each limit is a bucket holding up to one minute's allowance and refilling continuously;
one Lua script refills and takes in one step, on Redis's clock, so concurrent gateways
never race. A request takes 1 from the requests bucket when its headers arrive
(`RateLimit`, before its body is read), and, once tokenized, its prompt tokens plus
`max_tokens` for each completion it asks for from the tokens bucket (`charge_tokens`,
before any generation; what OpenAI counts). An empty bucket is 429 with Retry-After (when
it will hold enough); a request larger than a whole minute's tokens is 429 without one.

Redis down (or slower than `TIMEOUT_S`) fails open: the request is served and
`splitstack_rate_limit_fail_open_total` counts it; Redis is tried again after
`RETRY_AFTER_S`.
"""
from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from prometheus_client import Counter

from services.gateway.limits import GENERATION_PATHS, LimitMetrics, refuse
from services.gateway.protocol import APIError

log = logging.getLogger(__name__)

TIMEOUT_S = 0.25
RETRY_AFTER_S = 1.0

# KEYS[1]: the bucket (hash: tokens, ts). ARGV: capacity, refill per second, cost.
# Returns {taken (0/1), seconds until `cost` is there (string), tokens left (string)}.
TAKE = """
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1e6
local capacity, rate, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or capacity
local ts = tonumber(state[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - ts) * rate)
local taken, wait = 0, 0
if cost <= tokens then
  tokens = tokens - cost
  taken = 1
else
  wait = (cost - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(capacity / rate * 1000) + 1000)
return {taken, tostring(wait), tostring(tokens)}
"""


@dataclass(frozen=True)
class RateLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "splitstack:ratelimit"     # Redis keys: {prefix}:{client}:{rpm|tpm}

    def __post_init__(self):
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be at least 1, got {value!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute)


class Buckets:
    """The Redis side: `take(client, kind, cost)` -> (taken, seconds to wait). Fails open."""

    def __init__(self, limits: RateLimits, fail_open: Counter):
        import redis.asyncio as redis

        self.limits, self.fail_open = limits, fail_open
        self.redis = redis.Redis.from_url(limits.redis_url, socket_timeout=TIMEOUT_S,
                                          socket_connect_timeout=TIMEOUT_S)
        self.script = self.redis.register_script(TAKE)
        self.down_until = 0.0

    async def take(self, client: str, kind: str, cost: int) -> tuple[bool, float]:
        per_minute = (self.limits.requests_per_minute if kind == "rpm"
                      else self.limits.tokens_per_minute)
        if not per_minute:
            return True, 0.0
        if cost > per_minute:
            return False, float("inf")
        if time.monotonic() < self.down_until:
            self.fail_open.inc()
            return True, 0.0
        try:
            taken, wait, _ = await self.script(
                keys=[f"{self.limits.prefix}:{client}:{kind}"],
                args=[per_minute, per_minute / 60.0, cost])
        except Exception as exc:  # noqa: BLE001 — any Redis failure: serve, and count it
            self.down_until = time.monotonic() + RETRY_AFTER_S
            self.fail_open.inc()
            log.warning("rate limit store unreachable, serving without limits for %.0f s: %s",
                        RETRY_AFTER_S, type(exc).__name__)
            return True, 0.0
        return bool(int(taken)), float(wait)


def client_identity(scope) -> str:
    """The hashed bearer token, else the client address."""
    auth = dict(scope["headers"]).get(b"authorization", b"")
    if auth.lower().startswith(b"bearer ") and len(auth) > 7:
        return "key-" + hashlib.sha256(auth[7:].strip()).hexdigest()[:24]
    client = scope.get("client")
    return "addr-" + (client[0] if client else "unknown")


class RateLimit:
    """ASGI middleware: the requests bucket for generation routes; the tokens bucket is
    left in the request's state for `charge_tokens`."""

    def __init__(self, app, buckets: Buckets, metrics: LimitMetrics):
        self.app, self.buckets, self.metrics = app, buckets, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        client = client_identity(scope)
        taken, wait = await self.buckets.take(client, "rpm", 1)
        if not taken:
            error = APIError(429, f"rate limit reached: "
                                  f"{self.buckets.limits.requests_per_minute} requests per "
                                  f"minute", code="rate_limit_exceeded")
            return await refuse(scope, receive, send, error, "rate_limited", self.metrics,
                                retry_after=wait)
        scope.setdefault("state", {})["rate_limit"] = (self.buckets, client)
        await self.app(scope, receive, send)


async def charge_tokens(request, tokens: int) -> None:
    """Take `tokens` from the client's tokens bucket (no-op without a tokens limit);
    raises the 429 when they are not there."""
    entry = request.scope.get("state", {}).get("rate_limit")
    if entry is None:
        return
    buckets, client = entry
    taken, wait = await buckets.take(client, "tpm", tokens)
    if taken:
        return
    per_minute = buckets.limits.tokens_per_minute
    request.app.state.limit_metrics.refusals.labels("rate_limited").inc()
    if wait == float("inf"):
        raise APIError(429, f"the request needs {tokens} tokens (prompt plus max_tokens per "
                            f"completion), more than the limit of {per_minute} tokens per "
                            f"minute", code="rate_limit_exceeded")
    raise RateLimited(f"rate limit reached: {per_minute} tokens per minute; this request "
                      f"needs {tokens}", wait)


class RateLimited(APIError):
    """429 with the seconds until the bucket holds enough (the Retry-After header)."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(429, message, code="rate_limit_exceeded")
        self.retry_after = retry_after


def install(app, limits: RateLimits) -> None:
    """After `limits.install` (its metrics); the fail-open counter on the gateway's
    registry."""
    fail_open = Counter("splitstack_rate_limit_fail_open_total",
                        "Rate-limit checks passed without Redis because it was unreachable",
                        registry=app.state.gateway.metrics.registry)
    app.add_middleware(RateLimit, buckets=Buckets(limits, fail_open),
                       metrics=app.state.limit_metrics)

    async def rate_limited(_, exc: RateLimited):
        wait = str(max(1, math.ceil(exc.retry_after)))
        return JSONResponse(exc.body(), status_code=429, headers={"Retry-After": wait})

    app.add_exception_handler(RateLimited, rate_limited)
