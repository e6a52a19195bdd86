"""Derived checkpoints: rebuilt by `make setup` from SmolLM2 and the stored deltas."""
from __future__ import annotations

from pathlib import Path

import torch

from models import load_model
from models.zoo.derive import DELTA_DIR, LoraLinear

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo"


def test_deltas_fit_the_git_budget():
    total = sum(p.stat().st_size for p in DELTA_DIR.glob("*.safetensors"))
    assert 0 < total <= 60 * 2 ** 20


def test_qknorm_checkpoint_loads_in_hf_and_matches():
    from transformers import AutoModelForCausalLM

    path = ZOO / "smollm2-qknorm"
    ours = load_model(path)
    assert ours.config.model_type == "qwen3" and ours.config.qk_norm
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, 49152, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (ours.forward(ids) - ref).abs().max().item() <= 1e-4
    # the norms are really there and trained (not the identity they would start from)
    w = ours.layer(0).self_attn.q_norm.weight
    assert not torch.allclose(w, torch.ones_like(w))


def test_qknorm_distillation_recovers_the_parent():
    """On held-out text the distilled child is far closer to the parent than the
    calibration-only child it started from."""
    from evals.corpus import documents
    from models.zoo.derive import build_child, calibrate_norms
    from services.common.tokenizer import load_tokenizer

    parent_dir = ZOO / "smollm2-135m"
    tok = load_tokenizer(parent_dir)
    encode = lambda text: torch.tensor([tok(text, add_special_tokens=False)["input_ids"][:256]])
    ids = encode(documents("eval")[3].text)
    parent = load_model(parent_dir)
    trained = load_model(ZOO / "smollm2-qknorm")
    calibrated, _ = build_child(parent_dir, calibrate_norms(parent,
                                                            [encode(documents("calib")[5].text)]))
    ref = torch.log_softmax(parent.forward(ids), -1)

    def kl(model):
        q = torch.log_softmax(model.forward(ids), -1)
        return (ref.exp() * (ref - q)).sum(-1).mean().item()

    def loss(model):
        return torch.nn.functional.cross_entropy(model.forward(ids)[0, :-1], ids[0, 1:]).item()

    assert kl(trained) < 0.5 and kl(trained) < 0.35 * kl(calibrated)
    assert loss(trained) - loss(parent) < 0.3


def test_lora_merge_equals_factored_forward():
    base = torch.nn.Linear(8, 6, bias=False)
    lora = LoraLinear(base, rank=2, seed=0)
    with torch.no_grad():
        lora.B.normal_()
    x = torch.randn(3, 8)
    assert torch.allclose(lora(x), x @ lora.merged().T, atol=1e-6)
