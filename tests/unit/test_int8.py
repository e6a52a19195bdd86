"""Weight-only int8 (`--quantization int8`): the per-row quantizer's error bound, decode-sized
products on the int8 copy against the dequantized reference, prompts on the weights
unchanged, and a quantized model's engine against the plain one."""
from __future__ import annotations

import pytest
import torch

from models import load_model
from models.layers import INT8_MAX_ROWS, mark_int8, project, quantize_int8
from services.engine import EngineConfig, GenerationParams, LLMEngine
from tests.helpers.tail_replay import prompt

GREEDY = GenerationParams(max_tokens=6, ignore_eos=True, return_logits=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_rounds_to_within_half_its_step(dtype):
    w = (torch.randn(96, 64) * torch.linspace(0.01, 3, 96)[:, None]).to(dtype)
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.dtype == dtype and q.abs().max() <= 127
    err = (q.float() * scales.float()[:, None] - w.float()).abs()
    # the rounding step is the fp32 scale; its bf16 copy adds up to 2^-8 relative
    assert (err <= scales.float()[:, None] * (0.5 + 127 * 2 ** -8) + 1e-6).all()
    assert (q.abs().amax(1) >= 126).all()        # each row's peak uses the full range


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_sized_products_read_the_int8_copy_and_prompts_the_weight(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(80, 64, generator=g).to(dtype)
    bias = torch.randn(80, generator=g).to(dtype)
    ref_w = w.clone()
    mark_int8(w)
    q, scales = quantize_int8(w)
    deq = (q.float() * scales.float()[:, None])
    for rows in (1, 3, INT8_MAX_ROWS):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        got = project(x, w, bias).float()
        want = x.float() @ deq.T + bias.float()
        tol = 1e-4 if dtype == torch.float32 else 0.05 * want.abs().max().item()
        assert (got - want).abs().max().item() <= tol
        plain = project(x, ref_w, bias).float()
        assert (got - plain).abs().max().item() > 0         # it really is the int8 copy
    x = torch.randn(INT8_MAX_ROWS + 1, 64, generator=g).to(dtype)
    assert torch.equal(project(x, w, bias), project(x, ref_w, bias))


def test_unknown_quantization_is_refused(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama3")
    with pytest.raises(ValueError, match="unknown quantization"):
        load_model(path).quantize("int4")


@pytest.mark.parametrize("compile_decode", [False, True])
def test_a_quantized_model_decodes_near_the_plain_one(compile_decode, tiny_checkpoint):
    """Same greedy tokens on a tiny model, logits within a few percent; the compiled
    graph reads the same int8 copies as the eager step (same logits to rounding)."""
    path, _ = tiny_checkpoint("llama3")
    plain, quant = load_model(path), load_model(path).quantize("int8")
    cfg = dict(block_size=16, num_blocks=96, max_num_seqs=4)
    prompts = [prompt(40, seed=1), prompt(90, seed=2), prompt(7, seed=3)]
    ref = LLMEngine(plain, EngineConfig(**cfg)).generate(prompts, GREEDY)
    eager = LLMEngine(quant, EngineConfig(**cfg)).generate(prompts, GREEDY)
    for r, e in zip(ref, eager):
        a, b = torch.stack(r.logits), torch.stack(e.logits)
        assert 0 < (a - b).abs().max().item() <= 0.05 * a.abs().max().item()
    if compile_decode:
        engine = LLMEngine(quant, EngineConfig(**cfg, compile_decode=True,
                                               compile_buckets=(4,)))
        for e, c in zip(eager, engine.generate(prompts, GREEDY)):
            assert c.output_ids == e.output_ids
            assert (torch.stack(c.logits) - torch.stack(e.logits)).abs().max().item() <= 1e-4
        assert engine.runner.compiled.used == {4}
