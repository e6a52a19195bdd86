"""Prefix-cache hits with Tail-Replay: layer layouts, prompts and the hit counter."""
from __future__ import annotations

import torch

from services.prefix_cache import PrefixCache

L, F = "linear_attention", "full_attention"
INTERLEAVED = (L, F, L, L, F, L)   # a leading group, a two-layer group, a one-layer group


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hit_tokens(cache: PrefixCache, tier: str = "memory") -> float:
    return cache.metrics.registry.get_sample_value(
        "splitstack_prefix_cache_hit_tokens_total", {"tier": tier}) or 0.0
