"""The Redis tier of the prefix cache: a self-describing block encoding and the shared index.

Keys: `{redis_prefix}:blk:{key}` holds one encoded block, `{redis_prefix}:kids:{parent}` a
Redis hash child key -> child tokens (little-endian int64), so any replica pointing at the
same Redis can walk the chain another one inserted.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
import time

import numpy as np
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.prefix_cache.metrics import PrefixCacheMetrics
from services.prefix_cache.store import (Block, PrefixCacheConfig, block_key, check_rows,
                                         token_bytes)

_MAGIC, _VERSION = b"SSPC", 1
_PREAMBLE = struct.Struct("<4sBI")  # magic, version, header bytes
_DIGEST = 32  # sha256 over everything before it


class CorruptBlock(Exception):
    """A stored block that fails to decode: bad magic or checksum, truncated, inconsistent."""


def encode_block(block: Block) -> bytes:
    """magic, version, header length | JSON header | tensor bytes | sha256 of all before."""
    tensors = {"kv": block.kv, "hidden": block.hidden, "provenance": block.provenance}
    tensors = {k: t for k, t in tensors.items() if t is not None}
    header = json.dumps({
        "parent": block.parent, "tokens": list(block.tokens), "map_id": block.map_id,
        "tensors": [[k, str(t.dtype).removeprefix("torch."), list(t.shape)]
                    for k, t in tensors.items()],
    }).encode()
    body = b"".join([_PREAMBLE.pack(_MAGIC, _VERSION, len(header)), header]
                    + [t.reshape(-1).view(torch.uint8).numpy().tobytes()
                       for t in tensors.values()])
    return body + hashlib.sha256(body).digest()


def decode_block(key: str, data: bytes, block_size: int) -> Block:
    """Inverse of `encode_block`; raises `CorruptBlock` unless `data` is intact and keyed `key`."""
    end = len(data) - _DIGEST
    if end < _PREAMBLE.size or hashlib.sha256(data[:end]).digest() != data[end:]:
        raise CorruptBlock(f"{key}: truncated or checksum mismatch")
    magic, version, header_len = _PREAMBLE.unpack_from(data)
    if magic != _MAGIC or version != _VERSION:
        raise CorruptBlock(f"{key}: magic {magic!r} version {version}")
    try:
        header = json.loads(data[_PREAMBLE.size:_PREAMBLE.size + header_len])
        offset, tensors = _PREAMBLE.size + header_len, {}
        for name, dtype_name, shape in header["tensors"]:
            dtype = getattr(torch, dtype_name)
            size = math.prod(shape) * dtype.itemsize
            raw = bytearray(data[offset:offset + size])
            tensors[name] = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
            offset += size
        tokens = tuple(int(t) for t in header["tokens"])
        block = Block(key, header["parent"], tokens, tensors["kv"], tensors.get("hidden"),
                      tensors["provenance"], header["map_id"])
        check_rows(len(tokens), block.kv, block.hidden, block.provenance)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise CorruptBlock(f"{key}: {e}") from e
    if offset != end or not tokens or block_key(block.parent, block_size, tokens) != key:
        raise CorruptBlock(f"{key}: payload does not match its key")
    return block


class RedisTier:
    """Blocks and the child index in Redis. Never raises: a failure is counted, answered as
    a miss, and Redis is left alone for `redis_backoff_s`. Safe to call from any thread."""

    def __init__(self, config: PrefixCacheConfig, metrics: PrefixCacheMetrics):
        self.config, self.metrics = config, metrics
        t = config.redis_timeout_s
        self.client = redis.Redis.from_url(
            config.redis_url, socket_timeout=t, socket_connect_timeout=t,
            retry=Retry(NoBackoff(), 0), lib_name=None, lib_version=None)  # we back off instead
        self._down_until = 0.0

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
            if len(tokens) % 8:
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
