"""The prefix cache's device tier: slot accounting, LRU order, pins, inclusion in the memory
tier, and a hit restored through it, all on the CPU (the tier takes any device; on CUDA:
tests/unit/test_replay_graph.py)."""
from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from models import load_model
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.prefix_cache import PrefixCache, PrefixCacheConfig, PrefixCacheMetrics
from tests.helpers.tail_replay import prompt

F_, KV, D, BS = 2, 2, 4, 16
SLOT = F_ * 2 * BS * KV * D * 4          # bytes of one fp32 slot


def cache(slots: int, memory_bytes: int = 1 << 30) -> PrefixCache:
    return PrefixCache(PrefixCacheConfig(namespace="t", block_size=BS,
                                         capacity_bytes=memory_bytes,
                                         device_capacity_bytes=slots * SLOT + SLOT // 2),
                       PrefixCacheMetrics(CollectorRegistry()), device="cpu")


def store(c: PrefixCache, n: int, seed: int) -> list[int]:
    ids = prompt(n, seed)
    g = torch.Generator().manual_seed(seed)
    c.insert(ids, torch.randn(F_, 2, n, KV, D, generator=g), None,
             torch.zeros(n, dtype=torch.uint8))
    return ids


def gather(c: PrefixCache, ids: list[int]) -> torch.Tensor:
    with c.lookup(ids) as hit:
        kv = hit.kv_to("cpu")
        assert torch.equal(kv, hit.kv())
        return kv


def keys(c: PrefixCache, ids: list[int]) -> list[str]:
    with c.lookup(ids) as hit:
        return [b.key for b, _ in hit._parts]


def balanced(c: PrefixCache):
    s = c.device_tier.stats()
    assert s.used_slots + s.free_slots == s.slots and s.pinned_slots == 0
    return s


def test_gather_copies_once_then_reads_the_slots():
    c = cache(slots=4)
    ids = store(c, 50, seed=1)                           # blocks of 16, 16, 16 and 2 rows
    kv = gather(c, ids)
    assert kv.shape == (F_, 2, 50, KV, D)
    s = balanced(c)
    assert (s.slots, s.slot_bytes, s.used_slots) == (4, SLOT, 4)
    assert (s.copied_blocks, s.admitted_blocks, s.hit_blocks) == (4, 4, 0)
    assert s.bytes_used == 4 * SLOT                      # the partial block takes a slot
    assert c.metrics.registry.get_sample_value("splitstack_prefix_cache_device_bytes") \
        == 4 * SLOT
    assert torch.equal(gather(c, ids), kv)
    s = balanced(c)
    assert (s.copied_blocks, s.hit_blocks, s.evictions) == (4, 4, 0)
    assert torch.equal(gather(c, ids[:40]), kv[:, :, :40])   # a hit ending inside a block


def test_eviction_takes_the_least_recently_used_slot():
    c = cache(slots=3)
    a, b = store(c, 32, seed=1), store(c, 32, seed=2)
    ka, kb = keys(c, a), keys(c, b)
    gather(c, a)                                         # slots: a0 a1
    gather(c, b)                                         # a0 goes (LRU): a1 b0 b1
    tier = c.device_tier
    assert [tier.resident(k) for k in ka + kb] == [False, True, True, True]
    gather(c, a)                                         # a1 read (most recent), b0 goes
    assert [tier.resident(k) for k in ka + kb] == [True, True, False, True]
    s = balanced(c)
    assert (s.evictions, s.copied_blocks, s.hit_blocks, s.used_slots) == (2, 5, 1, 3)


def test_a_hit_larger_than_the_tier_passes_its_rest_through():
    c = cache(slots=2)
    ids = store(c, 64, seed=3)
    gather(c, ids)                                       # 4 blocks, 2 slots, all pinned
    s = balanced(c)
    assert (s.copied_blocks, s.admitted_blocks, s.used_slots, s.evictions) == (4, 2, 2, 0)
    assert [c.device_tier.resident(k) for k in keys(c, ids)] == [True, True, False, False]


def test_memory_eviction_discards_the_device_copy():
    """Inclusive tiers: a block the memory tier evicts leaves the device too."""
    c = cache(slots=8, memory_bytes=3 * (F_ * 2 * BS * KV * D * 4 + BS))
    a = store(c, 48, seed=4)
    ka = keys(c, a)
    gather(c, a)
    assert balanced(c).used_slots == 3
    store(c, 16, seed=5)                                 # evicts a's tail block from memory
    assert [c.device_tier.resident(k) for k in ka] == [True, True, False]
    s = balanced(c)
    assert (s.used_slots, s.free_slots) == (2, 6)


def test_a_block_discarded_while_a_gather_reads_it_frees_its_slot_after():
    c = cache(slots=4)
    ids = store(c, 32, seed=6)
    gather(c, ids)
    tier, (k0, _) = c.device_tier, keys(c, ids)
    assemble = tier._assemble

    def discard_midway(*args):
        tier.discard(k0)                                 # pinned: its slot is kept for now
        assert tier.stats().free_slots == 2
        return assemble(*args)

    tier._assemble = discard_midway
    gather(c, ids)
    s = balanced(c)
    assert not tier.resident(k0) and (s.used_slots, s.free_slots) == (1, 3)


def test_only_cacheable_blocks_are_admitted():
    c = cache(slots=4)
    ids = store(c, 32, seed=7)
    with c.lookup(ids) as hit:
        kv = c.device_tier.gather(hit._parts, cacheable=set())
        assert torch.equal(kv, hit.kv())
    s = balanced(c)
    assert (s.copied_blocks, s.admitted_blocks, s.used_slots) == (2, 0, 0)


def test_config_refuses_a_negative_device_capacity():
    with pytest.raises(ValueError, match="device_capacity_bytes"):
        PrefixCacheConfig(namespace="t", device_capacity_bytes=-1)


def test_engine_hit_through_the_device_tier_matches_no_cache(tiny_checkpoint):
    """The engine restores hits through `Hit.kv_to`: on a tier that holds the blocks (the
    second hit) the logits are those of a prefill without a cache (full replay)."""
    path, _ = tiny_checkpoint("qwen3_5")
    model = load_model(path)
    c = PrefixCache(PrefixCacheConfig(namespace="tiny", block_size=16,
                                      device_capacity_bytes=1 << 24),
                    PrefixCacheMetrics(CollectorRegistry()), device="cpu")
    cfg = EngineConfig(block_size=16, num_blocks=64, max_prefill_chunk=32)
    engine = LLMEngine(model, cfg, prefix_cache=c, replay_ratio=1.0)
    greedy = GenerationParams(max_tokens=3, ignore_eos=True, return_logits=True)
    base = prompt(70, seed=9)
    engine.generate([base], GenerationParams(max_tokens=1, ignore_eos=True))
    engine.prefix.drain()
    ref_engine = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64))
    for tail in ([5, 6, 7], [8, 9]):
        got = engine.generate([base + tail], greedy)[0]
        ref = ref_engine.generate([base + tail], greedy)[0]
        assert got.output_ids == ref.output_ids
        assert (torch.stack(got.logits) - torch.stack(ref.logits)).abs().max().item() <= 1e-4
    s = c.device_tier.stats()
    assert s.hit_blocks >= 4 and s.pinned_slots == 0       # the second hit read the slots
