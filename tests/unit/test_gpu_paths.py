"""The model, the engine, RidgeFill and the kernels on a CUDA device, against the same code
on the CPU (which the rest of the suite checks against HF `transformers`). Skipped where no
CUDA device exists, like CI."""
from __future__ import annotations

import pytest
import torch

from kernels.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
from models import load_model
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.prefill.maps import RidgeMaps
from services.prefill.ridgefill import RidgeFill
from services.prefill.settings import FillSettings
from tests.helpers.ridgefill import FAMILIES, prompt

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def full_fp32():
    """Compare in true fp32: no TF32 in matmuls or cuDNN convolutions."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


@pytest.mark.parametrize("family", ["qwen3", "llama3", "qwen3_next", "qwen3_5"])
def test_engine_on_cuda_matches_cpu(family, tiny_checkpoint):
    """Batched greedy decode of prompts of different lengths (chunked prefill, paged KV,
    GDN state slots) gives the CPU engine's tokens and logits."""
    path, _ = tiny_checkpoint(family)
    batch = [prompt(n, seed=n) for n in (7, 40, 130)]
    params = GenerationParams(max_tokens=8, ignore_eos=True, return_logits=True)
    cfg = EngineConfig(max_prefill_chunk=64, max_num_batched_tokens=128, num_blocks=64)
    ref = LLMEngine(load_model(path), cfg).generate(batch, params)
    got = LLMEngine(load_model(path, device="cuda"), cfg).generate(batch, params)
    for r, s in zip(got, ref):
        assert r.output_ids == s.output_ids
        assert (torch.stack(r.logits).cpu() - torch.stack(s.logits)).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_ridgefill_on_cuda_matches_cpu(family, four_layer, tiny_checkpoint):
    """The same maps on both devices: a filled prefill (split 2, a selector, value rescale)
    gives the CPU's KV, GDN states and logits; disabled, the CUDA engine's cache bitwise."""
    model, maps_dir = four_layer(family)
    gpu = load_model(maps_dir.parent, device="cuda")
    ids = prompt(150)
    s = FillSettings(split=2, tail=40, selector="random", budget=0.2, value_rescale=8)
    got = RidgeFill(gpu, RidgeMaps(maps_dir, gpu, 2)).prefill(ids, s)
    ref = RidgeFill(model, RidgeMaps(maps_dir, model, 2)).prefill(ids, s)
    assert got.num_filled == ref.num_filled > 0
    for l in ref.k:
        assert rel(got.k[l], ref.k[l]) < 1e-5 and rel(got.v[l], ref.v[l]) < 1e-5
    for l in ref.recurrent:
        assert rel(got.recurrent[l], ref.recurrent[l]) < 1e-4
    assert rel(got.logits, ref.logits) < 1e-4

    # disabled: the CUDA engine's own cache, bitwise
    engine = LLMEngine(gpu, EngineConfig(max_prefill_chunk=4096, max_num_batched_tokens=4096,
                                         num_blocks=32))
    sid = engine.add_request(ids, GenerationParams(max_tokens=2, return_logits=True))
    engine.step()
    seq = engine.seqs[sid]
    res = RidgeFill(gpu, RidgeMaps(maps_dir, gpu, 2)).prefill(
        ids, FillSettings(split=gpu.config.num_hidden_layers, tail=0))
    pos = torch.arange(150, device="cuda")
    slots = torch.tensor(seq.block_table, device="cuda")[pos // 16] * 16 + pos % 16
    for l in res.k:
        kvh, d = res.k[l].shape[1:]
        assert torch.equal(engine.cache.k(l).reshape(-1, kvh, d)[slots], res.k[l])
    for l in res.recurrent:
        gi = engine.cache.gdn_index[l]
        assert torch.equal(engine.cache.recurrent[gi, seq.state_slot], res.recurrent[l])
    assert torch.equal(seq.logits[0], res.logits[0])


@pytest.mark.parametrize("t,blocks", [(1, None), (100, None), (1100, None), (1100, 4)])
def test_chunked_delta_rule_on_cuda(t, blocks):
    g = torch.Generator().manual_seed(t)
    q, k = torch.randn(2, t, 2, 16, generator=g), torch.randn(2, t, 2, 16, generator=g)
    v = torch.randn(2, t, 4, 24, generator=g)
    decay = -torch.nn.functional.softplus(torch.randn(2, t, 4, generator=g) * 3)
    beta = torch.rand(2, t, 4, generator=g)
    s0 = torch.randn(2, 4, 16, 24, generator=g) * 0.3
    o_ref, s_ref = recurrent_gated_delta_rule(q.repeat_interleave(2, 2),
                                              k.repeat_interleave(2, 2), v, decay, beta, s0)
    want = torch.zeros(t, dtype=torch.bool)
    want[-1] = True
    o, s = chunk_gated_delta_rule(*(x.cuda() for x in (q, k, v, decay, beta, s0)),
                                  block_chunks=blocks)
    o2, s2 = chunk_gated_delta_rule(*(x.cuda() for x in (q, k, v, decay, beta, s0)),
                                    out_rows=want.cuda(), block_chunks=blocks)
    assert o.is_cuda and rel(o, o_ref) < 1e-5 and rel(s, s_ref) < 1e-5
    assert rel(s2, s_ref) < 1e-5 and rel(o2[:, -1], o_ref[:, -1]) < 1e-5


@pytest.mark.parametrize("overlap", [False, True])
def test_tail_replay_hit_on_cuda(overlap, tiny_checkpoint):
    """A hybrid's prefix-cache hit on CUDA (the KV copy on a side stream when overlapping):
    full replay gives the no-cache logits, and the hit's own prompt is stored too (its
    cached rows come from host memory, its new rows from the device)."""
    from prometheus_client import CollectorRegistry

    from services.prefix_cache import PrefixCache, PrefixCacheConfig, PrefixCacheMetrics

    path, _ = tiny_checkpoint("qwen3_5")
    model = load_model(path, device="cuda")
    cache = PrefixCache(PrefixCacheConfig(namespace="tiny", block_size=16),
                        PrefixCacheMetrics(CollectorRegistry()))
    cfg = EngineConfig(block_size=16, num_blocks=64, max_prefill_chunk=32)
    engine = LLMEngine(model, cfg, prefix_cache=cache, replay_ratio=1.0,
                       replay_overlap=overlap)
    P = prompt(120, seed=1)
    one = GenerationParams(max_tokens=1, ignore_eos=True)
    greedy = GenerationParams(max_tokens=4, ignore_eos=True, return_logits=True)
    engine.generate([P[:77]], one)
    got = engine.generate([P], greedy)[0]
    engine.prefix.drain()
    hits = cache.metrics.registry.get_sample_value("splitstack_prefix_cache_hit_tokens_total",
                                                   {"tier": "memory"})
    assert hits == 77
    ref = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64)).generate([P], greedy)[0]
    assert got.output_ids == ref.output_ids
    assert (torch.stack(got.logits) - torch.stack(ref.logits)).abs().max().item() <= 1e-4
    with cache.lookup(P + [0]) as hit:            # the hit's prompt was stored in full
        assert hit.length == 120
