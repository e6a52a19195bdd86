"""One checkpoint has one fingerprint whatever the serving dtype, and files stamped before
the bf16 rounding still match."""
from __future__ import annotations

import torch

from models import load_model
from services.prefill.maps import model_fingerprint, model_fingerprints


def test_fp32_and_bf16_loads_share_a_fingerprint(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama3")
    fp32, bf16 = load_model(path), load_model(path, dtype=torch.bfloat16)
    assert model_fingerprint(fp32) == model_fingerprint(bf16)
    legacy = model_fingerprint(fp32, exact_values=True)       # what older files carry
    assert legacy != model_fingerprint(fp32) and legacy in model_fingerprints(fp32)
    other, _ = tiny_checkpoint("llama3", seed=2)
    assert model_fingerprint(load_model(other)) not in model_fingerprints(fp32)
