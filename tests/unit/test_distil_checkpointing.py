"""Gradient checkpointing in the hybrid's logit stage (`derive hybrid
--gradient-checkpointing`): checkpointed layers and chunked logits give the plain path's
per-position KL and the same gradients."""
from __future__ import annotations

import pytest
import torch

from models import load_model
from models.random_checkpoint import save_random_checkpoint
from tools.zoo import derive_hybrid
from tools.zoo.hybrid_init import train_logits


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_configs):
    cfg = dict(tiny_configs["qwen3_5"], num_hidden_layers=4)
    cfg.pop("layer_types", None)
    models = []
    for seed in (3, 4):
        path = tmp_path_factory.mktemp(f"hybrid4-{seed}")
        save_random_checkpoint(cfg, path, seed=seed, std=0.1)
        models.append(load_model(path))
    return models


def _kl_and_grads(parent, child, ids, checkpoint):
    params = [p for p in child.parameters() if p.is_floating_point()]
    for p in params:
        p.requires_grad_(True)
        p.grad = None
    weights = torch.linspace(0.5, 2.0, ids.shape[1])       # a loss that weighs positions
    kl = derive_hybrid.distil_kl(parent, child, ids, checkpoint)
    (kl * weights).sum().backward()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    for p in params:
        p.requires_grad_(False)
        p.grad = None
    return kl.detach(), grads


def test_checkpointed_chunked_kl_equals_the_plain_one(pair, monkeypatch):
    parent, child = pair
    monkeypatch.setattr(derive_hybrid, "KL_CHUNK", 7)      # 20 positions: 3 chunks, a ragged one
    ids = torch.randint(0, 1000, (1, 20), generator=torch.Generator().manual_seed(0))
    kl, grads = _kl_and_grads(parent, child, ids, checkpoint=False)
    kl_c, grads_c = _kl_and_grads(parent, child, ids, checkpoint=True)
    assert kl.shape == kl_c.shape == (20,)
    assert kl.min().item() > 0                            # two different models
    with torch.no_grad():                                 # KL(parent || child) from the logits
        teacher = torch.log_softmax(train_logits(parent, ids), -1)[0]
        student = torch.log_softmax(train_logits(child, ids), -1)[0]
    torch.testing.assert_close(kl, (teacher.exp() * (teacher - student)).sum(-1),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kl_c, kl, rtol=1e-5, atol=1e-6)
    assert sum(g.abs().sum().item() for g in grads) > 0
    for g, g_c in zip(grads, grads_c):      # the chunks sum in another order: float noise
        scale = max(g.abs().max().item(), 1e-12)
        assert (g_c - g).abs().max().item() <= 1e-4 * scale
