"""Token-level prefix cache of Tail-Replay: FA KV, FA output hiddens and provenance per token.

A prompt is cut into blocks of `block_size` tokens; the last one may be partial. Each block
is keyed by a hash chained from the namespace (the model fingerprint), so equal keys mean
equal prefixes of the same model:

    tokens  t0 .. t15 | t16 .. t31 | t32 t33 t34
    key     h0        | h1         | h2           h_i = sha256(h_{i-1}, block_size, tokens_i)
                                     ^ partial, keyed by its own 3 tokens; always a leaf

A lookup follows full blocks by key. At the first miss it takes, among the children of the
last matched block, the one sharing the longest token prefix with the query and uses that
many of its rows, so a hit may end at any token.

Tiers: an LRU memory tier bounded in payload bytes, and an optional Redis tier that replicas
share (`redis_tier.py`). Redis hits are promoted into memory.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.prefix_cache.metrics import PrefixCacheMetrics

EXACT, FILLED = 0, 1  # provenance of a row


class PrefixCacheError(ValueError):
    """Rows whose shapes disagree with the tokens; carries the offending shape."""

    def __init__(self, name: str, shape: tuple, expected: str):
        super().__init__(f"{name} has shape {shape}; expected {expected}")
        self.name, self.shape = name, shape


@dataclass(frozen=True)
class PrefixCacheConfig:
    namespace: str                       # model fingerprint; seeds the chained hash
    block_size: int = 16
    capacity_bytes: int = 1 << 30        # payload bytes of the memory tier
    reuse_filled: bool = False           # when False a hit ends at its first filled row
    redis_url: str | None = None         # e.g. redis://127.0.0.1:6379/0; None: memory only
    redis_prefix: str = "splitstack:prefix_cache"
    redis_timeout_s: float = 0.25        # socket connect and read timeouts
    redis_ttl_s: int | None = None
    redis_backoff_s: float = 1.0         # no Redis call for this long after a failure

    def __post_init__(self):
        if not self.namespace:
            raise ValueError("namespace must be non-empty")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {self.capacity_bytes}")
        if self.redis_timeout_s <= 0 or self.redis_backoff_s < 0:
            raise ValueError(f"bad redis timeout/backoff {self.redis_timeout_s}, "
                             f"{self.redis_backoff_s}")
        if self.redis_ttl_s is not None and self.redis_ttl_s < 1:
            raise ValueError(f"redis_ttl_s must be >= 1 or None, got {self.redis_ttl_s}")


@dataclass(eq=False)
class Block:
    """`n <= block_size` consecutive rows of a prompt; tensors are contiguous CPU copies."""
    key: str
    parent: str
    tokens: tuple[int, ...]
    kv: torch.Tensor                 # [F, 2, n, KV, D]
    hidden: torch.Tensor | None      # [G, n, H]
    provenance: torch.Tensor         # uint8 [n]
    map_id: str | None
    pins: int = 0
    resident_kids: int = 0

    @property
    def nbytes(self) -> int:
        tensors = (self.kv, self.hidden, self.provenance)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def reusable_rows(self, reuse_filled: bool) -> int:
        filled = (self.provenance != EXACT).nonzero()
        return len(self.tokens) if reuse_filled or len(filled) == 0 else int(filled[0])


@dataclass(frozen=True)
class Inserted:
    blocks: int        # blocks new to the memory tier
    tokens: int        # their rows
    skipped: int       # rows not stored in memory: no room beside pinned blocks
    redis_tokens: int  # rows newly written to Redis


@dataclass(frozen=True)
class CacheStats:
    bytes_used: int
    capacity_bytes: int
    blocks: int
    pinned_blocks: int


def token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i8").tobytes()


def block_key(parent: str, block_size: int, tokens: Sequence[int]) -> str:
    h = hashlib.sha256(parent.encode())
    h.update(block_size.to_bytes(8, "little"))
    h.update(token_bytes(tokens))
    return h.digest()[:16].hex()


def root_key(namespace: str) -> str:
    """h_{-1}: the namespace's digest, so every index key is 32 hex digits."""
    return hashlib.sha256(namespace.encode()).digest()[:16].hex()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_rows(n: int, kv: torch.Tensor, hidden: torch.Tensor | None,
               provenance: torch.Tensor) -> None:
    """Raise `PrefixCacheError` unless the tensors hold `n` rows each."""
    if kv.dim() != 5 or kv.shape[1] != 2 or kv.shape[2] != n:
        raise PrefixCacheError("kv", tuple(kv.shape), f"[F, 2, {n}, KV, D]")
    if hidden is not None and (hidden.dim() != 3 or hidden.shape[1] != n):
        raise PrefixCacheError("hidden", tuple(hidden.shape), f"[G, {n}, H]")
    if provenance.shape != (n,) or provenance.dtype != torch.uint8:
        raise PrefixCacheError("provenance", tuple(provenance.shape), f"uint8 [{n}]")


