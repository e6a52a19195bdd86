"""Tail-Replay at bucketed lengths (CUDA graphs on a GPU): the buckets, the front padding's
exactness on the CPU, and on CUDA the captured graphs, the device tier and the Triton kernel
in the engine against a prefill without a cache."""
from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from kernels.cuda_graph import GraphCache, bucket_for, pow2_buckets
from models import load_model
from models.random_checkpoint import save_random_checkpoint
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.prefix_cache import PrefixCache, PrefixCacheConfig, PrefixCacheMetrics
from services.prefix_cache.replay import TailReplayConfig, prompt_rows, tail_replay
from services.prefix_cache.replay_graph import GraphedTailReplay
from tests.helpers.tail_replay import INTERLEAVED, prompt


def test_buckets():
    assert pow2_buckets(64, 4096) == (64, 128, 256, 512, 1024, 2048, 4096)
    assert pow2_buckets(50, 100) == (64, 128)
    assert [bucket_for(n, (64, 128)) for n in (0, 1, 64, 65, 128, 129)] == \
        [None, 64, 64, 128, 128, None]
    with pytest.raises(ValueError):
        pow2_buckets(8, 4)


def test_graph_cache_without_capture_runs_each_bucket_on_its_own_buffers():
    made, seen = [], []

    def make(k):
        made.append(k)
        return (torch.zeros(k),)

    def fn(x):
        seen.append(x.data_ptr())
        return (x * 2,)

    cache = GraphCache(fn, make, capture=False)
    for n, bucket in ((3, 4), (4, 4), (7, 8)):
        out, = cache.run(bucket, lambda inp: inp[0][:n].fill_(1.0))
        assert out.sum().item() == 2 * n
    assert made == [4, 8] and seen[0] == seen[1] != seen[2] and cache.captured == ()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, tiny_configs):
    """family -> a tiny hybrid with a leading group and hidden-fed groups (INTERLEAVED)."""
    out = {}

    def get(family: str, device: str = "cpu"):
        if (family, device) not in out:
            cfg = dict(tiny_configs[family], num_hidden_layers=len(INTERLEAVED),
                       layer_types=list(INTERLEAVED))
            path = tmp_path_factory.mktemp(f"rg-{family}")
            save_random_checkpoint(cfg, path, seed=4, std=0.1)
            out[family, device] = load_model(path, device=device)
        return out[family, device]

    return get


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next_moe"])
@pytest.mark.parametrize("ffn_skip", [True, False])
def test_front_padded_replay_gives_the_unpadded_states(hybrid, family, ffn_skip):
    model = hybrid(family)
    ids = torch.tensor(prompt(150, seed=3))
    _, hidden = prompt_rows(model, ids)
    graphed = GraphedTailReplay(model, ffn_skip, buckets=(64, 128), capture=False)
    for k in (3, 37, 64, 100):                      # 100: 28 padding rows in bucket 128
        tail, tail_hidden = ids[-k:], hidden[:, -k:]
        ref = tail_replay(model, tail, tail_hidden, ffn_skip)
        got = graphed(tail, tail_hidden)
        # the padded projections run at another shape, so fp32 rounding may differ (seen:
        # 1.8e-6 on a conv state of magnitude 4); a padding row leaking in moves it by O(1)
        assert torch.allclose(got.conv, ref.conv, atol=1e-5)
        assert torch.allclose(got.recurrent, ref.recurrent, atol=1e-5, rtol=1e-4)
    long = graphed(ids, hidden)                     # past the largest bucket: eager
    assert torch.equal(long.recurrent, tail_replay(model, ids, hidden, ffn_skip).recurrent)


def test_replay_graphs_follow_the_environment(monkeypatch):
    monkeypatch.setenv("SPLITSTACK_REPLAY_GRAPHS", "1")
    assert TailReplayConfig().cuda_graphs
    monkeypatch.delenv("SPLITSTACK_REPLAY_GRAPHS")
    assert not TailReplayConfig().cuda_graphs


@pytest.mark.gpu
def test_captured_replay_matches_eager_on_cuda(hybrid):
    model = hybrid("qwen3_5", "cuda")
    ids = torch.tensor(prompt(300, seed=5))
    _, hidden = prompt_rows(model, ids)
    graphed = GraphedTailReplay(model, buckets=(64, 128, 256))
    for k in (40, 100, 100, 200):                   # the second 100 replays bucket 128
        ref = tail_replay(model, ids[-k:], hidden[:, -k:])
        got = graphed(ids[-k:], hidden[:, -k:])
        assert torch.allclose(got.recurrent, ref.recurrent, atol=1e-5, rtol=1e-4)
        assert torch.allclose(got.conv, ref.conv, atol=1e-6)
    assert graphed.graphs.captured == (64, 128, 256)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_engine_hit_on_cuda_with_device_tier_graphs_and_kernel(hybrid, kernel, monkeypatch):
    """Device tier, replay graphs and the delta-rule kernel together: a full replay gives
    the logits of a prefill without a cache, the second hit reads the device tier."""
    monkeypatch.setenv("SPLITSTACK_GDN_KERNEL", kernel)
    monkeypatch.setenv("SPLITSTACK_REPLAY_GRAPHS", "1")
    model = hybrid("qwen3_5", "cuda")
    cache = PrefixCache(PrefixCacheConfig(namespace="tiny", block_size=16,
                                          device_capacity_bytes=1 << 26),
                        PrefixCacheMetrics(CollectorRegistry()), device="cuda")
    cfg = EngineConfig(block_size=16, num_blocks=128, max_prefill_chunk=64)
    engine = LLMEngine(model, cfg, prefix_cache=cache, replay_ratio=1.0, replay_overlap=True)
    assert engine.prefix._graphed is not None
    greedy = GenerationParams(max_tokens=3, ignore_eos=True, return_logits=True)
    base = prompt(200, seed=8)
    engine.generate([base], GenerationParams(max_tokens=1, ignore_eos=True))
    engine.prefix.drain()
    ref_engine = LLMEngine(model, EngineConfig(block_size=16, num_blocks=128))
    for tail in ([5, 6, 7], [8, 9]):
        got = engine.generate([base + tail], greedy)[0]
        ref = ref_engine.generate([base + tail], greedy)[0]
        assert got.output_ids == ref.output_ids
        assert (torch.stack(got.logits) - torch.stack(ref.logits)).abs().max().item() <= 1e-3
    s = cache.device_tier.stats()
    assert s.hit_blocks >= 12 and s.pinned_slots == 0
