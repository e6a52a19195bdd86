"""The hybrid's logit stage. Gradient checkpointing (`derive hybrid
--gradient-checkpointing`): checkpointed layers and chunked logits give the plain path's
per-position KL and the same gradients. Attention transfer (`--attn-weight`): the KL between
the two models' attention distributions in the layers that keep attention."""
from __future__ import annotations

import pytest
import torch

from models import load_model
from models.random_checkpoint import save_random_checkpoint
from tools.zoo import derive_hybrid
from tools.zoo.hybrid_init import attention_logprobs, train_logits


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
    kl, transfer = derive_hybrid.distil_kl(parent, child, ids, checkpoint)
    assert transfer.shape == (0,)                         # no attention transfer asked
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


def test_attention_logprobs_are_the_kernels_attention():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 11, h, 8, generator=g) for h in (6, 2, 2))    # 3 queries per KV
    logp = attention_logprobs(q, k)
    assert logp.shape == (6, 11, 11)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(6, 11))
    assert logp.exp().triu(1).max().item() == 0.0                          # causal
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
        enable_gqa=True)[0]                                                # [H, T, D]
    got = logp.exp() @ v[0].transpose(0, 1).repeat_interleave(3, 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _fa_layers(model):
    from models.config import FULL_ATTENTION
    return tuple(l for l, layer in enumerate(model.model.layers) if layer.kind == FULL_ATTENTION)


def test_attention_transfer_is_the_kl_of_the_attention_maps_and_trains_the_child(pair):
    parent, child = pair
    layers = _fa_layers(child)
    assert layers
    ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(2))
    _, same = derive_hybrid.distil_kl(parent, parent, ids, attn_layers=layers)
    torch.testing.assert_close(same, torch.zeros(len(layers)))           # a model vs itself
    q_proj = child.layer(layers[0]).self_attn.q_proj.weight
    q_proj.requires_grad_(True)
    try:
        _, transfer = derive_hybrid.distil_kl(parent, child, ids, attn_layers=layers)
        assert transfer.shape == (len(layers),) and transfer.min().item() > 0
        transfer.sum().backward()
        assert q_proj.grad is not None and q_proj.grad.abs().sum().item() > 0
    finally:
        q_proj.requires_grad_(False)
        q_proj.grad = None
    with torch.no_grad():                 # the value: KL per head and query row, averaged
        maps = {}
        for model in (parent, child):
            maps[model] = dict.fromkeys(layers)
            train_logits(model, ids, attn=maps[model])
        for i, l in enumerate(layers):
            pt, ps = (attention_logprobs(*maps[m][l]).exp() for m in (parent, child))
            rows = [(pt[h, t, : t + 1] * (pt[h, t, : t + 1] / ps[h, t, : t + 1]).log()).sum()
                    for h in range(pt.shape[0]) for t in range(16)]
            torch.testing.assert_close(transfer[i].detach(), torch.stack(rows).mean(),
                                       rtol=1e-4, atol=1e-6)


def test_attention_transfer_rejects_a_layer_without_attention(pair):
    parent, child = pair
    gdn = next(l for l in range(4) if l not in _fa_layers(child))
    with pytest.raises(ValueError, match="not full attention"):
        derive_hybrid.distil_kl(parent, child, torch.zeros(1, 4, dtype=torch.long),
                                attn_layers=(gdn,))
    with pytest.raises(ValueError, match="checkpointing"):
        derive_hybrid.distil_kl(parent, child, torch.zeros(1, 4, dtype=torch.long), True,
                                attn_layers=_fa_layers(child))
