"""Derived checkpoints: rebuilt by `make setup` from SmolLM2 and the stored deltas."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models import load_model
from models.zoo import DELTA_DIR
from tools.zoo.derive import DELTA, LoraLinear, apply_qknorm

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo"


def test_deltas_fit_the_git_budget():
    total = sum(p.stat().st_size for p in DELTA_DIR.glob("*.safetensors"))
    assert 0 < total <= 60 * 2 ** 20


@pytest.mark.slow
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


@pytest.mark.slow
def test_qknorm_delta_rebuilds_the_checkpoint_exactly(tmp_path):
    """`apply-qknorm` (what make setup runs) reproduces the zoo checkpoint bit for bit, the
    ballast rows included, and each layer's ballast pair stays out of q·k."""
    from safetensors.torch import load_file

    rebuilt = load_file(str(apply_qknorm(ZOO / "smollm2-135m", tmp_path / "qk")
                            / "model.safetensors"))
    zoo = load_file(str(ZOO / "smollm2-qknorm" / "model.safetensors"))
    assert rebuilt.keys() == zoo.keys()
    assert all(torch.equal(rebuilt[k], zoo[k]) for k in zoo)
    delta = load_file(str(DELTA))
    for key, rows in delta.items():
        if key.endswith("q_proj.ballast_rows"):
            d = zoo[key.replace("q_proj.ballast_rows", "q_norm.weight")].shape[0]
            assert rows.numel() == 2 * zoo[key.replace("ballast_rows", "weight")].shape[0] // d
            dims = rows[:2].tolist()
            assert dims[1] == dims[0] + d // 2          # one half-split rotary pair
            assert torch.all(zoo[key.replace("q_proj.ballast_rows", "q_norm.weight")][dims] == 0)


@pytest.mark.slow
def test_qknorm_distillation_recovers_the_parent():
    """On held-out text the ballast-pair calibration alone keeps the child close to the
    parent (plain least-squares QK-norm was at KL 1.45), and the distilled child is closer
    still."""
    from evals.corpus import documents
    from tools.zoo.derive import build_child, calibrate_qk
    from services.common.tokenizer import load_tokenizer

    parent_dir = ZOO / "smollm2-135m"
    tok = load_tokenizer(parent_dir)
    encode = lambda text: torch.tensor([tok(text, add_special_tokens=False)["input_ids"][:256]])
    ids = encode(documents("eval")[3].text)
    parent = load_model(parent_dir)
    trained = load_model(ZOO / "smollm2-qknorm")
    calibrated, _ = build_child(parent_dir, calibrate_qk(parent,
                                                         [encode(documents("calib")[5].text)])[0])
    ref = torch.log_softmax(parent.forward(ids), -1)

    def kl(model):
        q = torch.log_softmax(model.forward(ids), -1)
        return (ref.exp() * (ref - q)).sum(-1).mean().item()

    def loss(model):
        return torch.nn.functional.cross_entropy(model.forward(ids)[0, :-1], ids[0, 1:]).item()

    assert kl(calibrated) < 0.1                     # measured 0.036 (0.025 from 4 windows)
    assert kl(trained) < 0.05 and kl(trained) < kl(calibrated)          # measured 0.020
    assert abs(loss(trained) - loss(parent)) < 0.05


def test_lora_merge_equals_factored_forward():
    base = torch.nn.Linear(8, 6, bias=False)
    lora = LoraLinear(base, rank=2, seed=0)
    with torch.no_grad():
        lora.B.normal_()
    x = torch.randn(3, 8)
    assert torch.allclose(lora(x), x @ lora.merged().T, atol=1e-6)


def test_hybrid_delta_decodes_to_what_was_encoded(tiny_checkpoint):
    """`decode_delta` inverts `encode_delta` (LoRA factors, int8 rows, whole tensors): what
    `derive hybrid --init-delta` continues from is the stored checkpoint."""
    from models import load_model
    from tools.zoo.derive_hybrid import attach_trainables, decode_delta, encode_delta

    path, _ = tiny_checkpoint("qwen3_5")
    child = load_model(path)
    params = attach_trainables(child, rank=4, seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in params:
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    delta = encode_delta(child)
    plain, lora = decode_delta(delta)
    assert lora and plain
    for name, module in child.named_modules():
        if isinstance(module, LoraLinear):
            a, b = lora[name]
            assert torch.equal(a, module.A.detach().half()) and torch.equal(b, module.B.detach().half())
    for name, p in child.named_parameters():
        if not p.requires_grad or name.endswith((".A", ".B")):
            continue
        if name.endswith("in_proj_z.weight"):        # int8 with per-row scales
            step = p.detach().abs().amax(1, keepdim=True) / 127
            assert ((plain[name] - p.detach()).abs() <= step / 2 + 1e-7).all()
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            assert torch.equal(plain[name], p.detach().half().float())
        else:
            assert torch.equal(plain[name], p.detach())
