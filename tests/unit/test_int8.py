"""Int8 (`--quantization int8`): the per-row quantizer's error bound, decode-sized products on
the int8 copy (the native VNNI kernel where the CPU has it, torch's weight-only product
otherwise) against their references, prompts on the weights unchanged, and a quantized
model's engine against the plain one."""
from __future__ import annotations

import pytest
import torch

from models import load_model
from kernels.linear import cpu_int8
from models import layers
from models.layers import mark_int8, project, quantize_int8
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


@pytest.fixture(params=["native", "torch"])
def int8_path(request, monkeypatch):
    """Each int8 product path: the VNNI kernel (its plain-C loop without VNNI) and torch's."""
    native = request.param == "native"
    if native and not cpu_int8.available():
        pytest.fail("the native int8 kernel did not build (a C compiler is part of setup)")
    monkeypatch.setattr(layers, "_native_int8", lambda: native)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_sized_products_read_the_int8_copy_and_prompts_the_weight(dtype, int8_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(80, 64, generator=g).to(dtype)
    bias = torch.randn(80, generator=g).to(dtype)
    ref_w = w.clone()
    mark_int8(w)
    q, scales = quantize_int8(w)
    limit = layers.INT8_NATIVE_MAX_ROWS if int8_path == "native" else layers.INT8_MAX_ROWS
    for rows in (1, 3, limit):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        got = project(x, w, bias)
        assert got.dtype == dtype
        if int8_path == "native":      # int8 activations too: the kernel's own reference
            want = cpu_int8.reference(x, q, scales.float()) + bias.float()
        else:
            want = x.float() @ (q.float() * scales.float()[:, None]).T + bias.float()
        tol = 1e-4 if dtype == torch.float32 else 0.01 * want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= tol
        plain = project(x, ref_w, bias).float()
        assert (got.float() - plain).abs().max().item() > 0     # it really is the int8 copy
    x = torch.randn(limit + 1, 64, generator=g).to(dtype)
    assert torch.equal(project(x, w, bias), project(x, ref_w, bias))


def test_marked_for_prompts_every_product_reads_the_int8_copy(int8_path):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 32, generator=g)
    q, scales = quantize_int8(w)
    mark_int8(w, prompts=True)
    x = torch.randn(200, 32, generator=g)
    want = cpu_int8.reference(x, q, scales) if int8_path == "native" else \
        x @ (q.float() * scales[:, None]).T
    assert (project(x, w) - want).abs().max().item() <= 1e-4


def test_unknown_quantization_is_refused(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama3")
    with pytest.raises(ValueError, match="unknown quantization"):
        load_model(path).quantize("int4")


@pytest.mark.parametrize("compile_decode", [False, True])
def test_a_quantized_model_decodes_near_the_plain_one(compile_decode, tiny_checkpoint):
    """Logits within a few percent of the plain model's while both have decoded the same
    tokens (a flip only at a near-tie); the compiled graph reads the same int8 copies as the
    eager step (same logits to rounding)."""
    path, _ = tiny_checkpoint("llama3")
    plain, quant = load_model(path), load_model(path).quantize("int8")
    cfg = dict(block_size=16, num_blocks=96, max_num_seqs=4)
    prompts = [prompt(40, seed=1), prompt(90, seed=2), prompt(7, seed=3)]
    ref = LLMEngine(plain, EngineConfig(**cfg)).generate(prompts, GREEDY)
    eager = LLMEngine(quant, EngineConfig(**cfg)).generate(prompts, GREEDY)
    for r, e in zip(ref, eager):
        for step, (a, b) in enumerate(zip(r.logits, e.logits)):
            tol = 0.05 * a.abs().max().item()
            assert 0 < (a - b).abs().max().item() <= tol
            if r.output_ids[step] != e.output_ids[step]:
                # a near-tie of the random tiny model may flip; later steps see other inputs
                assert a[r.output_ids[step]] - a[e.output_ids[step]] <= 2 * tol
                break
    if compile_decode:
        engine = LLMEngine(quant, EngineConfig(**cfg, compile_decode=True,
                                               compile_buckets=(4,)))
        for e, c in zip(eager, engine.generate(prompts, GREEDY)):
            assert c.output_ids == e.output_ids
            assert (torch.stack(c.logits) - torch.stack(e.logits)).abs().max().item() <= 1e-4
        graphs = engine.runner.compiled
        assert graphs.used == {4}
        # where the native kernel runs, the graph calls it directly (kernels.torch_ops) for
        # every product: the layers' and the head's
        assert graphs.native
        assert all(rows == (layers.INT8_NATIVE_MAX_ROWS if layers._native_int8() else 0)
                   for rows in graphs.int8_rows)


@pytest.mark.parametrize("side", ["attention", "pool"])
def test_a_q_first_member_quantizes_what_it_holds(side, tiny_checkpoint):
    """Each side of the Q-First split frees the weights it does not hold (empty
    placeholders); quantizing it builds int8 copies of what it holds and skips the rest."""
    from models.split import keep_side

    path, _ = tiny_checkpoint("llama3")
    model = load_model(path)
    keep_side(model, side)
    model.quantize("int8")
    layer = model.model.layers[0]
    held = layer.mlp.down_proj.weight if side == "pool" else layer.self_attn.o_proj.weight
    freed = layer.self_attn.o_proj.weight if side == "pool" else layer.mlp.down_proj.weight
    assert held.numel() and getattr(held, "_splitstack_int8", None) is not None
    assert freed.numel() == 0 and getattr(freed, "_splitstack_int8", None) is None
    x = torch.randn(2, held.shape[1])
    assert (project(x, held) - x @ held.T).abs().max().item() < 0.05 * (x @ held.T).abs().max()


def test_quantize_moves_the_native_copies_into_one_buffer(tiny_checkpoint):
    """Where the native kernel runs, a quantized model's decode weights share one buffer in
    the order a step reads them (layer by layer, the head last); elsewhere they are torch's
    copies, left where they are."""
    path, _ = tiny_checkpoint("llama3")
    model = load_model(path).quantize("int8")
    order = []
    for layer in model.model.layers:
        order += [layer.self_attn.qkv.weight, layer.self_attn.o_proj.weight,
                  layer.mlp.gate_up.weight, layer.mlp.down_proj.weight]
    order.append(model.lm_head_weight())
    copies = [layers.int8_copy(w) for w in order]
    if not layers._native_int8():
        assert all(c.packed is None and c.q is not None for c in copies)
        return
    starts = [c.packed.data.data_ptr() for c in copies]
    assert starts == sorted(starts) and starts[0] % cpu_int8.HUGE_PAGE == 0


def test_the_eval_scores_int8_as_served_or_as_its_strict_bound():
    """`eval --quantization int8 --served-quantization` keeps the prompts' products on the
    weights, as `serve --quantization int8` does: its teacher-forced losses (prompt rows)
    equal the plain model's exactly, where the strict bound (int8 everywhere) moves them."""
    from evals.run import EvalConfig, run_eval
    from tests.helpers.gateway import ZOO

    cfg = EvalConfig(lengths=(512,), tasks=(), families=("passkey",), n_items=1, n_docs=1,
                     tail_len=128, resamples=100)

    def loss(**quant) -> float:
        summary = run_eval(ZOO, ["exact"], cfg, log=lambda *a: None, **quant)
        return summary["arms"]["exact"]["new_token_loss"]["all"]["mean"]

    plain = loss()
    assert loss(quantization="int8", quantize_prompts=False) == plain
    assert loss(quantization="int8", quantize_prompts=True) != plain


def test_served_quantization_without_a_quantization_is_refused(capsys):
    from tools.commands.eval import run

    with pytest.raises(SystemExit) as exit_:
        run(["--model", "unused", "--served-quantization"])
    assert exit_.value.code == 2
    assert "--served-quantization needs --quantization" in capsys.readouterr().err
