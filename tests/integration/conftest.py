"""Fixtures for the prefix cache's Redis tier, against the real server at 127.0.0.1:6379."""
from __future__ import annotations

from uuid import uuid4

import pytest
import redis
from prometheus_client import CollectorRegistry

from services.prefix_cache import PrefixCache, PrefixCacheConfig, PrefixCacheMetrics
from tests.helpers.redis_tier import BS, REDIS_URL


@pytest.fixture
def redis_client():
    """A client of the real server; the test is skipped when none answers."""
    c = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
    try:
        c.ping()
    except redis.exceptions.RedisError as e:
        pytest.skip(f"no Redis at {REDIS_URL}: {e}")
    yield c
    c.close()


@pytest.fixture
def make_cache(redis_client):
    """PrefixCache factory over a key prefix of its own; its keys are deleted afterwards."""
    prefix = f"splitstack-test:{uuid4().hex}"
    caches = []

    def make(url=REDIS_URL, namespace="model-a", **kw):
        cache = PrefixCache(PrefixCacheConfig(namespace=namespace, block_size=BS, redis_url=url,
                                              redis_prefix=prefix, **kw),
                            PrefixCacheMetrics(CollectorRegistry()))
        caches.append(cache)
        return cache

    make.prefix = prefix
    yield make
    for cache in caches:
        cache.close()
    keys = list(redis_client.scan_iter(match=f"{prefix}:*"))
    if keys:
        redis_client.delete(*keys)
