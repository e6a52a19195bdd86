"""Q-First disaggregated decode (standard wiring, local transport) against the exact engine."""
from __future__ import annotations

import pytest
import torch

from models import load_model
from services.attention.service import AttentionService
from services.attention.shard import KVShard
from services.common.transport import PoolUnavailable, make_transport
from services.engine import GenerationParams, LLMEngine
from services.mlp_pool import MLPPool
from tests.conftest import FAMILIES

PARAMS = GenerationParams(max_tokens=12, ignore_eos=True, return_logits=True)


def build(model, num_shards=1, replicas=1, num_blocks=64, block_size=4):
    shards = [KVShard(model.config, i, num_shards, num_blocks, block_size, model.dtype)
              for i in range(num_shards)]
    pools = [MLPPool(model, f"pool-{i}") for i in range(replicas)]
    return AttentionService(model, shards, make_transport("local", pools)), shards, pools


def prompts(n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1024, (length,), generator=gen).tolist()
            for length in (5, 23, 9, 40)[:n]]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("num_shards,replicas", [(1, 1), (3, 2)])
def test_matches_exact_engine(family, num_shards, replicas, tiny_checkpoint):
    path, _ = tiny_checkpoint(family)
    model = load_model(path)
    ref = LLMEngine(model).generate(prompts(), PARAMS)
    service, shards, pools = build(model, num_shards, replicas)
    got = service.generate(prompts(), PARAMS)
    for r, s in zip(got, ref):
        assert r.output_ids == s.output_ids
        assert (torch.stack(r.logits) - torch.stack(s.logits)).abs().max().item() <= 1e-4
    for shard in shards:                           # every block back, on every shard
        assert shard.blocks.num_free == shard.blocks.num_blocks
        shard.blocks.check()
    if num_shards == 3:                            # the KV really was spread over shards
        assert all(shard.blocks.num_blocks for shard in shards)
    if replicas == 2:
        assert all(p.calls > 0 for p in pools)


def test_shards_hold_disjoint_positions(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path)
    service, shards, _ = build(model, num_shards=3, block_size=4)
    rid = service.add_request(list(range(1, 30)), GenerationParams(max_tokens=2))
    service.step()
    # 29 prompt positions = blocks 0..7: shard 0 holds blocks 0,3,6; 1 holds 1,4,7; 2 holds 2,5
    assert [len(s.tables[rid]) for s in shards] == [3, 3, 2]


def test_failed_pool_replica_is_retried_with_same_tokens(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_5")
    model = load_model(path)
    ref = [r.output_ids for r in LLMEngine(model).generate(prompts(), PARAMS)]
    service, _, pools = build(model, replicas=2)
    real = pools[0].stage
    state = {"calls": 0}

    def dying(*args):
        state["calls"] += 1
        if state["calls"] > 5:                     # the replica dies mid-generation
            raise ConnectionError("replica pool-0 is gone")
        return real(*args)

    pools[0].stage = dying
    got = [r.output_ids for r in service.generate(prompts(), PARAMS)]
    assert got == ref and service.pool.retries > 0


def test_all_replicas_down_raises(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    service, _, pools = build(load_model(path))
    pools[0].stage = lambda *a: (_ for _ in ()).throw(ConnectionError("down"))
    service.add_request([1, 2, 3], GenerationParams(max_tokens=2))
    with pytest.raises(PoolUnavailable, match="down"):
        service.step()


def test_wiring_must_match_checkpoint(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path)
    with pytest.raises(ValueError, match="trained for 'standard'"):
        AttentionService(model, [], make_transport("local", [MLPPool(model)]), wiring="qfirst")
