"""Q-First disaggregated decode (standard wiring, local transport) against the exact engine:
the same `LLMEngine` and scheduler, with the Q-First runner underneath."""
from __future__ import annotations

import pytest
import torch

from kernels.sampling import SamplingParams
from models import load_model
from services.attention.runner import QFirstRunner, qfirst_engine
from services.common.messages import RequestError
from services.common.transport import PoolUnavailable
from services.deployment.transports import make_transport
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.engine.runner import CacheLayout
from services.mlp_pool import MLPPool
from tests.helpers.checkpoints import FAMILIES

PARAMS = GenerationParams(max_tokens=12, ignore_eos=True, return_logits=True)


def build(model, num_shards=1, replicas=1, num_blocks=64, block_size=4, **config):
    """An attention service's engine: `num_blocks` engine blocks, each `block_size`
    positions on every one of `num_shards` shards."""
    pools = [MLPPool(model, f"pool-{i}") for i in range(replicas)]
    engine = qfirst_engine(model, make_transport("local", pools), num_shards=num_shards,
                           block_size=block_size, num_blocks=num_blocks, **config)
    return engine, engine.runner.shards, pools


def no_leaks(engine):
    engine.blocks.check()
    assert engine.blocks.num_free == engine.blocks.num_blocks


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
    no_leaks(service)                              # every block back
    if num_shards == 3:                            # the KV really was spread over shards
        assert all(bool(shard.kv.any()) for shard in shards)
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
    table = service.seqs[rid].block_table
    assert len(table) == 3                         # 29 positions, 12 per engine block
    # 29 prompt positions = shard blocks 0..7: shard 0 holds 0,3,6; 1 holds 1,4,7; 2 holds 2,5
    written = []
    for s in shards:
        rows, slots = s.slots([table] * 29, list(range(29)))
        assert rows == [p for p in range(29) if (p // 4) % 3 == s.index]
        filled = s.kv[0, 0].abs().sum((0, -1)).flatten()        # [blocks · block_size]
        assert filled[slots].ne(0).all() and int(filled.ne(0).sum()) == len(rows)
        written += rows
    assert sorted(written) == list(range(29))


def test_chunked_prefill_beside_decode_is_exact(tiny_checkpoint):
    """Prompts longer than a chunk are prefilled over several steps while other requests
    decode in the same steps (the scheduler's token budget), as in the exact engine."""
    path, _ = tiny_checkpoint("qwen3_5")
    model = load_model(path)
    config = dict(max_prefill_chunk=8, max_num_batched_tokens=12)
    ref = LLMEngine(model, EngineConfig(**config)).generate(prompts(), PARAMS)
    service, shards, _ = build(model, num_shards=2, **config)
    ids = [service.add_request(p, PARAMS) for p in prompts()]
    mixed = 0
    while service.has_unfinished():
        before = {s.seq_id: s.num_computed for s in service.scheduler.running}
        service.step()
        grew = [s for s in service.scheduler.running if s.seq_id in before
                and s.num_computed - before[s.seq_id] > 1]
        mixed += bool(grew) and any(s.output_ids for s in service.scheduler.running)
    got = [service.pop(i) for i in ids]
    assert mixed > 0                               # some step held decode and prefill rows
    for r, s in zip(got, ref):
        assert r.output_ids == s.output_ids
        assert (torch.stack(r.logits) - torch.stack(s.logits)).abs().max().item() <= 1e-4
    no_leaks(service)


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
    assert got == ref and service.runner.pool.retries > 0


def test_all_replicas_down_fails_the_step_and_frees_its_kv(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    service, shards, pools = build(load_model(path))
    pools[0].stage = lambda *a: (_ for _ in ()).throw(ConnectionError("down"))
    rid = service.add_request([1, 2, 3], GenerationParams(max_tokens=2))
    [out] = service.step()
    assert out.finished and out.finish_reason == "error"
    assert PoolUnavailable.__name__ in out.error and "down" in out.error
    assert service.seqs[rid].error == out.error and not service.has_unfinished()
    no_leaks(service)


def test_wiring_must_match_checkpoint(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path)
    with pytest.raises(ValueError, match="trained for 'standard'"):
        QFirstRunner(model, make_transport("local", [MLPPool(model)]), CacheLayout(8, 4, 2),
                     wiring="qfirst")


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
        before = {s.seq_id for s in service.scheduler.running}
        service.step()
        preempted += len(before & {s.seq_id for s in service.scheduler.waiting})
        peak = max(peak, service.blocks.num_used)
    assert [service.pop(i).output_ids for i in ids] == ref
    assert preempted > 0 and peak <= 12
    no_leaks(service)


def test_abort_frees_blocks_and_refuses_oversized_requests(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    service, shards, _ = build(load_model(path), num_shards=2, num_blocks=8, block_size=4)
    with pytest.raises(RequestError, match="exceeds the context length 64"):
        service.add_request(list(range(1, 60)), GenerationParams(max_tokens=20))
    rid = service.add_request(list(range(1, 20)), GenerationParams(max_tokens=8))
    service.step()
    assert service.blocks.num_used > 0
    service.abort(rid)
    assert service.seqs[rid].finish_reason == "abort" and not service.has_unfinished()
    no_leaks(service)


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
    assert not service.seqs and not service.has_unfinished()
    rid = service.add_request([1, 2, vocab - 1], GenerationParams(max_tokens=2, ignore_eos=True))
    while service.has_unfinished():
        service.step()
    assert len(service.seqs[rid].output_ids) == 2
    no_leaks(service)
