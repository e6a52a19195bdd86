"""Tail-Replay and RidgeFill arms of the eval harness, against the exact arm."""
from __future__ import annotations

import pytest
import torch

from evals.catalog import make_arm
from models import load_model
from models.random_checkpoint import save_random_checkpoint


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, tiny_configs):
    cfg = dict(tiny_configs["qwen3_5"], num_hidden_layers=8)
    cfg.pop("layer_types", None)
    path = tmp_path_factory.mktemp("hybrid8")
    save_random_checkpoint(cfg, path, seed=5, std=0.1)
    return load_model(path)


def ids(n, seed=0):
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_replay_is_exact_and_zero_only_is_not(hybrid):
    prompt = ids(200)
    exact = make_arm("exact", hybrid)
    ref = exact.tail_logits(prompt, 32)
    full = make_arm("tailreplay", hybrid, tail=32, replay_ratio=1.0)
    torch.testing.assert_close(full.tail_logits(prompt, 32), ref, atol=1e-4, rtol=0)
    zero = (make_arm("zero-only", hybrid, tail=32).tail_logits(prompt, 32) - ref).abs().max()
    short = (make_arm("tailreplay-10", hybrid, tail=32).tail_logits(prompt, 32) - ref).abs().max()
    assert zero > 1e-3 and short < zero
    assert full.complete([prompt], 5) == exact.complete([prompt], 5)


def test_dense_reuse_is_exact(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path)
    prompt = ids(120, seed=1)
    ref = make_arm("exact", model).tail_logits(prompt, 16)
    for name in ("zero-only", "tailreplay-5"):
        got = make_arm(name, model, tail=16).tail_logits(prompt, 16)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_exact_arm_holds_an_item_at_the_full_context_and_configs_are_checked():
    """The exact arm's engine fits one item at the model's whole context (SmolLM2's 8K is
    past the engine's default 256 MiB cache, 5.8K tokens); bad eval sizes are refused."""
    from pathlib import Path

    from evals.run import EvalConfig
    from services.engine import LLMEngine

    zoo = Path(__file__).resolve().parents[2] / "models" / "zoo" / "smollm2-135m"
    model = load_model(zoo)
    assert LLMEngine(model).max_model_len < 8192            # what the arm has to overcome
    assert make_arm("exact", model).engine.max_model_len == 8192
    with pytest.raises(ValueError, match="n_items and n_docs"):
        EvalConfig(n_items=-1)
    with pytest.raises(ValueError, match="tail_len"):
        EvalConfig(lengths=(300,))
