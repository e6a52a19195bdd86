"""Q-First disaggregated decode (standard wiring, local transport) against the exact engine."""
from __future__ import annotations

import pytest
import torch

from kernels.sampling import SamplingParams
from models import load_model
from services.attention.service import AttentionService
from services.attention.shard import KVShard
from services.common.transport import PoolUnavailable, make_transport
from services.engine import GenerationParams, LLMEngine
from services.engine.sequence import RequestError
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


def test_penalties_and_bias_give_the_exact_engines_tokens(tiny_checkpoint):
    """The pool samples with the request's tokens handed over on each final call."""
    path, _ = tiny_checkpoint("qwen3_5")
    model = load_model(path)
    params = GenerationParams(max_tokens=12, ignore_eos=True, sampling=SamplingParams(
        temperature=0.8, seed=4, repetition_penalty=1.3, frequency_penalty=0.5,
        presence_penalty=0.5, logit_bias=((11, 3.0),)))
    ref = LLMEngine(model).generate(prompts(), params)
    service, _, _ = build(model, num_shards=2, replicas=2)
    got = service.generate(prompts(), params)
    assert [r.output_ids for r in got] == [s.output_ids for s in ref]
    plain = LLMEngine(model).generate(prompts(), GenerationParams(
        max_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=4)))
    assert [s.output_ids for s in plain] != [s.output_ids for s in ref]


def test_prompt_logprobs_are_the_exact_engines(tiny_checkpoint):
    """The pool scores the prompt rows of the requests that ask (local transport here)."""
    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path)
    params = GenerationParams(max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    service, _, _ = build(model, num_shards=2)
    outs = {}
    ids = [service.add_request(p, params) for p in prompts()]
    while service.has_unfinished():
        for out in service.step():
            outs.setdefault(out.seq_id, out)
    engine = LLMEngine(model)
    eids = [engine.add_request(p, params) for p in prompts()]
    want = {}
    while engine.has_unfinished():
        for out in engine.step():
            want.setdefault(out.seq_id, out)
    for i, e in zip(ids, eids):
        got, ref = outs[i].prompt_logprobs, want[e].prompt_logprobs
        assert [g.token for g in got] == [r.token for r in ref] and len(got) > 0
        assert max(abs(g.logprob - r.logprob) for g, r in zip(got, ref)) < 1e-4
        assert [[t for t, _ in g.top] for g in got] == [[t for t, _ in r.top] for r in ref]


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


def test_all_replicas_down_fails_the_step_and_frees_its_kv(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    service, shards, pools = build(load_model(path))
    pools[0].stage = lambda *a: (_ for _ in ()).throw(ConnectionError("down"))
    rid = service.add_request([1, 2, 3], GenerationParams(max_tokens=2))
    [out] = service.step()
    assert out.finished and out.finish_reason == "error"
    assert PoolUnavailable.__name__ in out.error and "down" in out.error
    assert service.requests[rid].error == out.error and not service.has_unfinished()
    assert shards[0].blocks.num_free == shards[0].blocks.num_blocks


def test_wiring_must_match_checkpoint(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path)
    with pytest.raises(ValueError, match="trained for 'standard'"):
        AttentionService(model, [], make_transport("local", [MLPPool(model)]), wiring="qfirst")


def test_preemption_when_kv_runs_out_recomputes_with_same_tokens(tiny_checkpoint):
    """Too few blocks for all four requests at once: the newest is preempted and recomputed
    from its tokens; every request still ends with the exact engine's tokens."""
    path, _ = tiny_checkpoint("qwen3_next")
    model = load_model(path)
    ref = [r.output_ids for r in LLMEngine(model).generate(prompts(), PARAMS)]
    service, shards, _ = build(model, num_shards=2, num_blocks=12, block_size=4)
    ids = [service.add_request(p, PARAMS) for p in prompts()]
    preempted, peak = 0, 0
    while service.has_unfinished():
        before = {r.seq_id for r in service.running()}
        service.step()
        preempted += len(before & {r.seq_id for r in service.waiting})
        peak = max(peak, max(s.blocks.num_used for s in shards))
    assert [service.pop(i).output_ids for i in ids] == ref
    assert preempted > 0 and peak <= 12
    for shard in shards:
        assert shard.blocks.num_free == shard.blocks.num_blocks
        shard.blocks.check()


def test_abort_frees_blocks_and_refuses_oversized_requests(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    service, shards, _ = build(load_model(path), num_shards=2, num_blocks=8, block_size=4)
    with pytest.raises(Exception, match="KV cache"):
        service.add_request(list(range(1, 60)), GenerationParams(max_tokens=20))
    rid = service.add_request(list(range(1, 20)), GenerationParams(max_tokens=8))
    service.step()
    assert sum(s.blocks.num_used for s in shards) > 0
    service.abort(rid)
    assert service.requests[rid].finish_reason == "abort" and not service.has_unfinished()
    assert all(s.blocks.num_free == s.blocks.num_blocks for s in shards)


def test_out_of_vocabulary_prompt_is_refused_before_the_pool(tiny_checkpoint):
    """An id outside the vocabulary is the request's error (the gateway's 400), not a
    failure of every pool replica that tries to embed it."""
    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path)
    service, shards, _ = build(model)
    vocab = model.config.vocab_size
    for bad in ([5, -1, 7], [vocab], [3, True]):
        with pytest.raises(RequestError, match=r"token ids must be integers in \[0, "):
            service.add_request(bad, GenerationParams(max_tokens=4))
    assert not service.requests and not service.has_unfinished()
    rid = service.add_request([1, 2, vocab - 1], GenerationParams(max_tokens=2, ignore_eos=True))
    while service.has_unfinished():
        service.step()
    assert len(service.requests[rid].output_ids) == 2
    assert all(s.blocks.num_free == s.blocks.num_blocks for s in shards)
