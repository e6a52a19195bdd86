"""`splitstack convert-qfirst` (seed 003, §6): only Wq of layers ≥ 1 moves, the loss of the
rewired model falls, and the saved checkpoint records its wiring and serves under it."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from models import load_model
from models.loader import read_state_dict
from services.attention.runner import qfirst_engine
from services.deployment.transports import make_transport
from services.engine import GenerationParams, LLMEngine
from services.mlp_pool import MLPPool
from tools.zoo.convert_qfirst import (RESULT_FILE, ConversionError, ConvertConfig, HeldOut,
                                      convert_qfirst, lm_loss, rewire)
from tools.zoo.hybrid_init import train_logits


def copy_task(n: int, half: int, seed: int) -> torch.Tensor:
    """[n, 2·half + 1] windows: random tokens, then the same tokens again (the second half
    is predictable only by attending back, so the query matters)."""
    first = torch.randint(0, 1024, (n, half), generator=torch.Generator().manual_seed(seed))
    return torch.cat([first, first, first[:, :1]], 1)


@pytest.fixture(scope="module", params=["llama3", "qwen3_5"])
def converted(request, tiny_checkpoint, tmp_path_factory):
    src, _ = tiny_checkpoint(request.param)
    out = tmp_path_factory.mktemp("qfirst") / "converted"
    cfg = ConvertConfig(steps=12, seq_len=32, batch=2, lr=3e-3, warmup=2, eval_docs=2)
    train = copy_task(8, 16, seed=0)
    heldout = HeldOut(copy_task(2, 16, seed=1), n_bytes=4 * 2 * 32, source="copy task")
    result = convert_qfirst(src, out, train, heldout, cfg, log=lambda m: None,
                            source="copy task")
    return src, out, train, result


def test_only_wq_of_layers_above_0_changed(converted):
    src, out, _, result = converted
    before, after = read_state_dict(src, torch.float32), read_state_dict(out, torch.float32)
    assert before.keys() == after.keys()
    n_layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    repaired = {f"model.layers.{l}.self_attn.q_proj.weight" for l in range(1, n_layers)} \
        & before.keys()
    assert repaired                             # full-attention layers above layer 0
    for name in before:
        if name in repaired:
            assert not torch.equal(before[name], after[name]), name
        else:
            assert torch.equal(before[name], after[name]), name
    raw_src = load_file(str(src / "model.safetensors"))
    assert set(load_file(str(out / "model.safetensors"))) == set(raw_src)   # same names
    assert result["trainable_params"] == sum(before[n].numel() for n in repaired)


def test_config_and_report_record_the_wiring(converted):
    src, out, _, result = converted
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["splitstack_wiring"] == "qfirst"
    assert load_model(out).config.wiring == "qfirst"
    saved = json.loads((out / RESULT_FILE).read_text())
    assert saved["d"] == result["d"]
    bpb = saved["bpb"]
    assert all(math.isfinite(v) for v in bpb.values())
    assert saved["d"] == pytest.approx(bpb["converted_sft"] - bpb["unconverted_sft"])
    assert saved["untrained"] == pytest.approx(bpb["rewired"] - bpb["unconverted"])
    assert saved["untrained"] != 0.0                                # the rewiring is real
    assert saved["budget"]["tokens_per_arm"] == 12 * 2 * 32


def test_training_forward_matches_the_exact_qfirst_forward(converted):
    src, _, train, _ = converted
    model = rewire(load_model(src))
    with torch.no_grad():
        got = train_logits(model, train[:2, :-1])
    assert (got - model.forward(train[:2, :-1])).abs().max().item() <= 1e-4


def test_fine_tune_lowers_the_rewired_models_loss(converted):
    src, out, train, _ = converted
    with torch.no_grad():
        rewired = lm_loss(rewire(load_model(src)), train).item()
        after = lm_loss(load_model(out), train).item()
    assert after < rewired - 1e-3


def test_converted_checkpoint_serves_qfirst_only(converted):
    _, out, _, _ = converted
    model = load_model(out)
    params = GenerationParams(max_tokens=5, ignore_eos=True)
    seq = LLMEngine(model).generate([[1, 2, 3, 4]], params)[0]
    assert len(seq.output_ids) == 5
    ref = model.forward(torch.tensor([seq.tokens[:-1]]))[0].argmax(-1)[3:].tolist()
    assert seq.output_ids == ref                                    # greedy, q-first forward
    pool = make_transport("local", [MLPPool(model)])
    with pytest.raises(ValueError, match="trained for 'qfirst'"):
        qfirst_engine(model, pool, wiring="standard")


def test_refuses_an_already_converted_checkpoint(converted, tmp_path):
    _, out, train, _ = converted
    heldout = HeldOut(train[:1], n_bytes=100)
    with pytest.raises(ConversionError, match="already wired 'qfirst'"):
        convert_qfirst(out, tmp_path / "again", train, heldout, ConvertConfig(steps=1))


def test_bad_budget_is_refused():
    for bad in ({"steps": 0}, {"seq_len": 0}, {"lr": 0.0}, {"warmup": -1}):
        with pytest.raises(ConversionError, match=next(iter(bad))):
            ConvertConfig(**bad)


def test_cli_refuses_a_model_without_tokenizer(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint("llama3")
    proc = subprocess.run([sys.executable, "-m", "services.cli", "convert-qfirst",
                           "--model", str(path), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2 and "no tokenizer.json" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
