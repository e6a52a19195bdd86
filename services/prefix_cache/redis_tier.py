"""The Redis tier of the prefix cache: encoded blocks and the child index, shared by replicas.

Keys: `{redis_prefix}:blk:{key}` holds one encoded block (`block.encode_block`), and
`{redis_prefix}:kids:{parent}` a Redis hash child key -> child tokens (little-endian int64),
so a replica pointing at the same Redis walks the chains another one inserted.
"""
from __future__ import annotations

import logging
import time
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.prefix_cache.block import (Block, CorruptBlock, decode_block, encode_block,
                                         token_bytes)
from services.prefix_cache.config import PrefixCacheConfig
from services.prefix_cache.metrics import PrefixCacheMetrics



log = logging.getLogger(__name__)


def redact(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + host))


class RedisTier:
    """Blocks and the child index in Redis. Never raises: a failure is counted, answered as
    a miss, and Redis is left alone for `redis_backoff_s`. Safe to call from any thread."""

    def __init__(self, config: PrefixCacheConfig, metrics: PrefixCacheMetrics):
        self.config, self.metrics = config, metrics
        for kind in ("unavailable", "timeout", "corrupt"):   # exported at 0 from the start
            metrics.errors.labels(tier="redis", kind=kind)
        t = config.redis_timeout_s
        self.client = redis.Redis.from_url(
            config.redis_url, socket_timeout=t, socket_connect_timeout=t,
            retry=Retry(NoBackoff(), 0), lib_name=None, lib_version=None)  # we back off instead
        self._down_until = 0.0
        # say so at startup when Redis does not answer (the tier then works as misses, and
        # `splitstack_prefix_cache_errors_total{tier="redis"}` counts the attempts)
        if not self._call(lambda c: c.ping(), False):
            log.warning("prefix cache: Redis at %s does not answer; the Redis tier serves "
                        "misses until it does", redact(config.redis_url))

    def _key(self, kind: str, key: str) -> str:
        return f"{self.config.redis_prefix}:{kind}:{key}"

    def _call(self, fn, default):
        if time.monotonic() < self._down_until:
            return default
        try:
            return fn(self.client)
        except (redis.exceptions.TimeoutError, TimeoutError):
            kind = "timeout"
        except (redis.exceptions.RedisError, OSError):
            kind = "unavailable"
        self._down_until = time.monotonic() + self.config.redis_backoff_s
        self.metrics.errors.labels(tier="redis", kind=kind).inc()
        return default

    def get(self, key: str) -> Block | None:
        name = self._key("blk", key)
        data = self._call(lambda c: c.get(name), None)
        if data is None:
            return None
        try:
            return decode_block(key, data, self.config.block_size)
        except CorruptBlock:
            self.metrics.errors.labels(tier="redis", kind="corrupt").inc()
            self._call(lambda c: c.delete(name), None)  # so the next insert rewrites it
            return None

    def kids(self, parent: str) -> dict[str, tuple[int, ...]]:
        raw = self._call(lambda c: c.hgetall(self._key("kids", parent)), {})
        kids = {}
        for child, tokens in raw.items():
            if not tokens or len(tokens) % 8 or not child.isascii():
                self.metrics.errors.labels(tier="redis", kind="corrupt").inc()
                continue
            kids[child.decode()] = tuple(np.frombuffer(tokens, dtype="<i8").tolist())
        return kids

    def put(self, blocks: list[Block]) -> int:
        """Write the blocks Redis lacks and index all of them; returns the rows written."""
        names = [self._key("blk", b.key) for b in blocks]
        ttl = self.config.redis_ttl_s

        def write(client) -> int:
            with client.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.exists(name)
                present = pipe.execute()
            with client.pipeline(transaction=False) as pipe:
                for block, name, there in zip(blocks, names, present):
                    if not there:
                        pipe.set(name, encode_block(block), ex=ttl)
                    elif ttl:
                        pipe.expire(name, ttl)
                    kids = self._key("kids", block.parent)
                    pipe.hset(kids, block.key, token_bytes(block.tokens))
                    if ttl:
                        pipe.expire(kids, ttl)
                pipe.execute()
            return sum(len(b.tokens) for b, there in zip(blocks, present) if not there)

        return self._call(write, 0)

    def close(self) -> None:
        self.client.close()
