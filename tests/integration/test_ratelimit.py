"""One client must not starve the rest: per-API-key token buckets in the local Redis, shared
by every gateway that uses it; 429 with Retry-After past a limit; Redis down fails open and
is counted. Two gateways run in process (httpx's ASGI transport) over an engine that plays
back tokens."""
from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
import redis

from services.gateway.app import build_app
from services.gateway.gateway import Gateway
from services.gateway.ratelimit import RateLimits
from tests.helpers.held_engine import HeldEngine

pytestmark = pytest.mark.slow

URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="module")
def tokenizer():
    from services.common.tokenizer import load_tokenizer
    from tests.helpers.gateway import ZOO
    return load_tokenizer(ZOO)


@pytest.fixture
def prefix():
    """A key prefix of this test's own, deleted after it."""
    try:
        redis.Redis.from_url(URL).ping()
    except redis.RedisError:
        pytest.skip("needs Redis on 127.0.0.1:6379")
    name = f"splitstack-test:{uuid.uuid4().hex}"
    yield name
    client = redis.Redis.from_url(URL)
    for key in client.scan_iter(f"{name}:*"):
        client.delete(key)


def gateway_app(tokenizer, limits: RateLimits):
    return build_app(Gateway(HeldEngine(), tokenizer, "m", 512), rate_limits=limits)


async def send(app, key: str, count: int, **body):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return [await client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"model": "m", "prompt": "hi", "max_tokens": 2, **body})
                for _ in range(count)]


def counter(app, name: str) -> dict:
    return {tuple(s.labels.items()): s.value
            for m in app.state.gateway.metrics.registry.collect() for s in m.samples
            if s.name == name}


def test_requests_per_minute_are_shared_by_gateways(tokenizer, prefix):
    limits = RateLimits(requests_per_minute=5, redis_url=URL, prefix=prefix)
    a, b = gateway_app(tokenizer, limits), gateway_app(tokenizer, limits)

    async def run():
        first = await send(a, "key-1", 3)
        second = await send(b, "key-1", 3)        # the same key through another gateway
        other = await send(b, "key-2", 1)         # another key has its own bucket
        return first, second, other
    first, second, other = asyncio.run(run())
    statuses = [r.status_code for r in first + second]
    assert statuses == [200] * 5 + [429]
    refused = second[-1]
    assert 1 <= int(refused.headers["retry-after"]) <= 12        # one request refills in 12 s
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert other[0].status_code == 200
    keys = redis.Redis.from_url(URL).keys(f"{prefix}:*")
    assert keys and not any(b"key-1" in k for k in keys)           # keys are hashed
    assert counter(b, "splitstack_http_refusals_total") == {(("reason", "rate_limited"),): 1}


def test_tokens_per_minute_count_prompt_and_max_tokens(tokenizer, prefix):
    app = gateway_app(tokenizer, RateLimits(tokens_per_minute=100, redis_url=URL,
                                            prefix=prefix))

    async def run():
        ok = await send(app, "k", 1, max_tokens=40, n=2)      # 2 × (1 prompt + 40) = 82
        over = await send(app, "k", 1, max_tokens=40)         # 41 > 18 left
        huge = await send(app, "k", 1, max_tokens=200)        # more than a minute's worth
        return ok[0], over[0], huge[0]
    ok, over, huge = asyncio.run(run())
    assert ok.status_code == 200
    assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1
    assert "100 tokens per minute" in over.json()["error"]["message"]
    assert huge.status_code == 429 and "retry-after" not in huge.headers


def test_redis_down_fails_open_and_is_counted(tokenizer):
    limits = RateLimits(requests_per_minute=1, redis_url="redis://127.0.0.1:1/0")
    app = gateway_app(tokenizer, limits)
    responses = asyncio.run(send(app, "k", 3))
    assert [r.status_code for r in responses] == [200] * 3
    assert counter(app, "splitstack_rate_limit_fail_open_total") == {(): 3}
