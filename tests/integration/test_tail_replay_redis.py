"""Two engines sharing the Redis tier at 127.0.0.1:6379: what one stores, the other reuses."""
from __future__ import annotations

import pytest
import torch

from models import load_model
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.prefix_cache import PrefixCache, PrefixCacheConfig
from tests.helpers.tail_replay import INTERLEAVED, hit_tokens, prompt

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family,layout", [("qwen3", None), ("qwen3_5", INTERLEAVED)])
def test_second_engine_hits_what_the_first_stored(family, layout, make_cache, tiny_checkpoint,
                                                  tiny_configs, tmp_path):
    """Replica A stores P[:m] in Redis; replica B, its memory tier empty, hits it there.
    Its logits are bitwise those of engine C, which stored and hit P[:m] in its own memory
    tier only (the same rows, restored and replayed the same way)."""
    if layout is None:
        model = load_model(tiny_checkpoint(family)[0])
    else:
        from models.random_checkpoint import save_random_checkpoint
        cfg = dict(tiny_configs[family], num_hidden_layers=len(layout), layer_types=list(layout))
        save_random_checkpoint(cfg, tmp_path, seed=2, std=0.1)
        model = load_model(tmp_path)
    P, m = prompt(90, seed=12), 53
    p = GenerationParams(max_tokens=4, ignore_eos=True, return_logits=True)
    one = GenerationParams(max_tokens=1, ignore_eos=True)
    cfg = EngineConfig(block_size=16, num_blocks=64)
    b_cache = make_cache(namespace=family)
    a = LLMEngine(model, cfg, prefix_cache=make_cache(namespace=family))
    b = LLMEngine(model, cfg, prefix_cache=b_cache)
    c_cache = PrefixCache(PrefixCacheConfig(namespace=family, block_size=16))
    c = LLMEngine(model, cfg, prefix_cache=c_cache)
    a.generate([P[:m]], one)
    a.prefix.drain()
    c.generate([P[:m]], one)
    from_memory = c.generate([P], p)[0]
    from_redis = b.generate([P], p)[0]
    assert hit_tokens(c_cache, "memory") == m and hit_tokens(b_cache, "redis") == m
    assert torch.equal(torch.stack(from_memory.logits), torch.stack(from_redis.logits))
    for engine in (a, b, c):
        engine.prefix.drain()
        assert engine.blocks.num_free == engine.blocks.num_blocks
        assert engine.prefix.cache.stats().pinned_blocks == 0
