"""Decode-only steps as compiled graphs (`--compile`): the compiled step gives the eager
engine's tokens and logits, pads batches to buckets exactly, leaves steps past its buckets
and models it cannot run to the eager step, and accounts for every block."""
from __future__ import annotations

import pytest
import torch

from models import load_model
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.engine import compiled_decode
from tests.helpers.tail_replay import prompt

GREEDY = GenerationParams(max_tokens=6, ignore_eos=True, return_logits=True)
PROMPTS = [prompt(40, seed=1), prompt(300, seed=2), prompt(7, seed=3)]   # 3 rows: bucket 4


def engines(model, buckets=(1, 4)):
    base = dict(block_size=16, num_blocks=96, max_num_seqs=4)
    compiled = LLMEngine(model, EngineConfig(**base, compile_decode=True,
                                             compile_buckets=buckets))
    return compiled, LLMEngine(model, EngineConfig(**base))


def assert_same(compiled, plain, prompts, tol):
    got, ref = compiled.generate(prompts, GREEDY), plain.generate(prompts, GREEDY)
    for g, r in zip(got, ref):
        assert g.output_ids == r.output_ids
        assert (torch.stack(g.logits) - torch.stack(r.logits)).abs().max().item() <= tol


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_compiled_decode_steps_match_the_engine(family, tiny_checkpoint):
    """Llama (GQA, no QK-norm) and Qwen3 (QK-norm): same greedy tokens, fp32 logits within
    rounding, batch 3 padded to bucket 4 and batch 1 in its own graph."""
    path, _ = tiny_checkpoint(family)
    compiled, plain = engines(load_model(path))
    runner = compiled.runner
    assert runner.compiled is not None and runner.compiled.compiled == {1, 4}
    assert_same(compiled, plain, PROMPTS, 1e-4)
    assert_same(compiled, plain, PROMPTS[:1], 1e-4)
    assert runner.compiled.used == {1, 4}
    for engine in (compiled, plain):
        assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_python_operators_give_the_native_operators_steps(dtype, tiny_checkpoint,
                                                              monkeypatch):
    """Where `kernels.torch_ops` cannot build, the graph calls the Python custom ops (the
    same kernels through ctypes, the same oneDNN product): the same logits as the native
    operators' graph. In bf16 every product is the native `bf16_linear`."""
    from kernels import torch_ops
    from models.layers import _ONEDNN_BF16

    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path, dtype=dtype)
    native, _ = engines(model, buckets=(4,))
    assert native.runner.compiled.native
    assert all(native.runner.compiled.bf16) == (dtype == torch.bfloat16 and _ONEDNN_BF16)
    monkeypatch.setattr(torch_ops, "available", lambda: False)
    python, _ = engines(model, buckets=(4,))
    assert not python.runner.compiled.native and not any(python.runner.compiled.bf16)
    for a, b in zip(native.generate(PROMPTS, GREEDY), python.generate(PROMPTS, GREEDY)):
        if dtype == torch.float32:
            assert a.output_ids == b.output_ids
            assert (torch.stack(a.logits) - torch.stack(b.logits)).abs().max().item() <= 1e-5
        else:
            # the native graph hands attention q in fp32 straight from the fused rotary,
            # where the Python op gets it rounded to bf16: the first compiled step's logits
            # agree to bf16 rounding
            first = (a.logits[1] - b.logits[1]).abs().max().item()
            assert first <= 0.02 * b.logits[1].abs().max().item()
    assert python.runner.compiled.used == native.runner.compiled.used == {4}


def test_bf16_compiled_decode_keeps_the_greedy_tokens(tiny_checkpoint):
    """In bf16 the graph fuses the pointwise ops (rounding where the eager step rounds
    between ops may differ): the logits stay within bf16 noise of the eager step's."""
    path, _ = tiny_checkpoint("llama3")
    compiled, plain = engines(load_model(path, dtype=torch.bfloat16), buckets=(4,))
    got, ref = compiled.generate(PROMPTS, GREEDY), plain.generate(PROMPTS, GREEDY)
    for g, r in zip(got, ref):
        first = (g.logits[1] - r.logits[1]).abs().max().item()   # the first compiled step
        assert first <= 0.05 * r.logits[1].abs().max().item()
    assert compiled.runner.compiled.used == {4}


def test_graphs_built_beside_the_engine_never_touch_its_requests(tiny_checkpoint,
                                                                  monkeypatch):
    """`compile_in_background` (what a server does): steps run eagerly until the bucket's
    graph is built, then through it, with the eager engine's tokens and logits. The
    warm-up runs on a scratch cache, so a request holding block 0 while the graphs build
    keeps its keys and values."""
    import threading

    go = threading.Event()
    warm = compiled_decode.CompiledDecode.warm
    threads = []

    def gated_warm(self, up_to=None):
        go.wait(60)
        return warm(self, up_to)

    def spawn(self):
        threads.append(start(self))
        return threads[-1]

    start = compiled_decode.CompiledDecode.warm_in_background
    monkeypatch.setattr(compiled_decode.CompiledDecode, "warm", gated_warm)
    monkeypatch.setattr(compiled_decode.CompiledDecode, "warm_in_background", spawn)
    path, _ = tiny_checkpoint("llama3")
    model = load_model(path)
    base = dict(block_size=16, num_blocks=96, max_num_seqs=4, compile_decode=True,
                compile_buckets=(1,))
    engine = LLMEngine(model, EngineConfig(**base, compile_in_background=True))
    plain = LLMEngine(model, EngineConfig(**{**base, "compile_decode": False}))
    graphs = engine.runner.compiled
    assert graphs.compiled == set() and graphs.pending() == 1 and len(threads) == 1
    params = GenerationParams(max_tokens=10, ignore_eos=True, return_logits=True)
    seq_id = engine.add_request(PROMPTS[0], params)
    for _ in range(4):                                   # the prompt, then eager decode steps
        engine.step()
    assert 0 in engine.seqs[seq_id].block_table and graphs.used == set()
    go.set()
    threads[0].join(300)
    assert graphs.pending() == 0 and graphs.compiled == {1}
    while engine.has_unfinished():
        engine.step()
    got, ref = engine.pop(seq_id), plain.generate([PROMPTS[0]], params)[0]
    assert graphs.used == {1}
    assert got.output_ids == ref.output_ids
    assert (torch.stack(got.logits) - torch.stack(ref.logits)).abs().max().item() <= 1e-4
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_steps_past_the_buckets_and_prefill_steps_run_eagerly(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama3")
    compiled, plain = engines(load_model(path), buckets=(1, 2))
    assert compiled.runner.compiled.batch_buckets == (1, 2)
    assert_same(compiled, plain, PROMPTS, 1e-4)          # 3 rows: past bucket 2
    assert compiled.runner.compiled.used == set()


def test_models_the_graph_cannot_run_keep_the_eager_step(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_5")                 # Gated DeltaNet layers
    model = load_model(path)
    assert "Gated DeltaNet" in compiled_decode.unsupported(model)
    engine, _ = engines(model)
    assert engine.runner.compiled is None
    assert len(engine.generate(PROMPTS[:1], GREEDY)[0].output_ids) == GREEDY.max_tokens


def test_buckets_follow_max_num_seqs():
    pick = LLMEngine._compile_buckets
    assert pick(EngineConfig(max_num_seqs=16, compile_decode=True)) == (1, 2, 4, 8, 16)
    assert pick(EngineConfig(max_num_seqs=5, compile_decode=True)) == (1, 2, 4, 8)
    assert pick(EngineConfig(max_num_seqs=5)) == ()
    with pytest.raises(ValueError, match="compile_buckets"):
        pick(EngineConfig(compile_decode=True, compile_buckets=(0, 2)))


def test_the_cache_dir_is_set_for_inductor(tmp_path, monkeypatch):
    monkeypatch.delenv(compiled_decode.CACHE_ENV, raising=False)
    chosen = compiled_decode.use_cache_dir(tmp_path / "inductor")
    assert chosen.is_dir()
    import os

    assert os.environ[compiled_decode.CACHE_ENV] == str(chosen)


def test_a_failed_compile_leaves_the_eager_step(tiny_checkpoint, monkeypatch):
    def fail(self, up_to=None):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled_decode.CompiledDecode, "warm", fail)
    path, _ = tiny_checkpoint("llama3")
    compiled, plain = engines(load_model(path))
    assert compiled.runner.compiled is None
    assert_same(compiled, plain, PROMPTS, 0.0)
