"""Decode-only steps at bucketed shapes (CUDA graphs on a GPU): the padded step gives the
engine's tokens and logits, eagerly on the CPU and captured on CUDA."""
from __future__ import annotations

import pytest
import torch

from models import load_model
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.engine.decode_graph import DecodeGraphs
from tests.helpers.tail_replay import prompt

GREEDY = GenerationParams(max_tokens=5, ignore_eos=True, return_logits=True)
PROMPTS = [prompt(40, seed=1), prompt(300, seed=2), prompt(7, seed=3)]   # 3 rows: bucket 4


def engines(model, capture: bool):
    cfg = EngineConfig(block_size=16, num_blocks=96, max_num_seqs=4)
    graphed, plain = LLMEngine(model, cfg), LLMEngine(model, cfg)
    runner = graphed.runner
    runner.decode_graphs = DecodeGraphs(runner, 1024, capture=capture)
    return graphed, plain


def assert_same(graphed, plain, tol):
    got, ref = graphed.generate(PROMPTS, GREEDY), plain.generate(PROMPTS, GREEDY)
    for g, r in zip(got, ref):
        assert g.output_ids == r.output_ids
        assert (torch.stack(g.logits) - torch.stack(r.logits)).abs().max().item() <= tol


@pytest.mark.parametrize("family", ["llama3", "qwen3_5", "qwen3_next_moe"])
def test_padded_decode_steps_match_the_engine(family, tiny_checkpoint):
    """Rows padded with copies of row 0 and keys masked past each row's length change
    nothing: same tokens, logits within rounding."""
    path, _ = tiny_checkpoint(family)
    graphed, plain = engines(load_model(path), capture=False)
    assert_same(graphed, plain, 1e-4)
    used = graphed.runner.decode_graphs.graphs.used
    assert (4, 512) in used and all(b == 4 for b, _ in used)   # 301 + 4 keys: bucket 512
    assert graphed.blocks.num_free == graphed.blocks.num_blocks


def test_rotary_lookup_without_host_sync_gives_the_same_values(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama3")
    rotary = load_model(path).rotary
    positions = torch.tensor([0, 5, 300, 17])
    ref = rotary.cos_sin(positions, torch.float32)
    with rotary.without_host_sync(512, positions.device):
        got = rotary.cos_sin(positions, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_buckets_refuse_steps_past_them(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama3")
    graphed, _ = engines(load_model(path), capture=False)
    graphs = graphed.runner.decode_graphs
    assert graphs.len_buckets == (256, 512, 1024)
    small = DecodeGraphs(graphed.runner, 1024, batch_buckets=(1, 2))
    graphed.runner.decode_graphs = small
    got = graphed.generate(PROMPTS, GREEDY)                 # 3 rows: past bucket 2, eager
    assert len(got) == 3 and small.graphs.used == ()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama3", "qwen3_5"])
def test_captured_decode_steps_match_the_engine_on_cuda(family, tiny_checkpoint):
    path, _ = tiny_checkpoint(family)
    graphed, plain = engines(load_model(path, device="cuda"), capture=True)
    assert_same(graphed, plain, 1e-4)
    assert graphed.runner.decode_graphs.graphs.captured
