"""Fused q/k/v and gate/up weights, and the bf16 packed product: the same outputs, the
separate modules still usable, and the fused path left whenever it could be stale."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import load_model
from models.config import FULL_ATTENTION
from models.layers import _ONEDNN_BF16, project, still_fused
from tests.helpers.checkpoints import FAMILIES


def unfused(model):
    for layer in model.model.layers:
        if layer.kind == FULL_ATTENTION:
            layer.self_attn.qkv = None
        if hasattr(layer.mlp, "gate_up"):
            layer.mlp.gate_up = None
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_model_gives_the_unfused_logits(family, tiny_checkpoint, tiny_configs):
    path, _ = tiny_checkpoint(family)
    fused = load_model(path)
    attn = next(l.self_attn for l in fused.model.layers if l.kind == FULL_ATTENTION)
    assert attn.qkv is not None and attn.qkv.weight.data_ptr() == attn.q_proj.weight.data_ptr()
    ids = torch.randint(0, tiny_configs[family]["vocab_size"], (2, 40),
                        generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fused.forward(ids), unfused(load_model(path)).forward(ids),
                               rtol=1e-5, atol=1e-5)


def test_fused_weights_are_the_modules_weights(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    with torch.no_grad():
        attn.v_proj.weight.mul_(2.0)          # an edit through the module reaches the fused copy
    rows = attn.q_proj.weight.shape[0] + attn.k_proj.weight.shape[0]
    assert torch.equal(attn.qkv.weight[rows:], attn.v_proj.weight)
    # the state dict still names (and round-trips) the separate tensors
    state = model.state_dict()
    assert "model.layers.0.mlp.gate_proj.weight" in state
    assert torch.equal(state["model.layers.0.mlp.up_proj.weight"], mlp.up_proj.weight)


def test_fused_path_is_left_when_it_could_be_stale(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path)
    attn = model.model.layers[0].self_attn
    mods = (attn.q_proj, attn.k_proj, attn.v_proj)
    with torch.no_grad():
        assert still_fused(attn.qkv, *mods) is attn.qkv
    assert still_fused(attn.qkv, *mods) is None                   # recording gradients
    model.to(torch.bfloat16)                                      # weights moved: views gone
    with torch.no_grad():
        assert still_fused(attn.qkv, *mods) is None
    model = load_model(path)
    attn = model.model.layers[0].self_attn
    attn.k_proj = torch.nn.Linear(*reversed(attn.k_proj.weight.shape), bias=False)
    with torch.no_grad():
        assert still_fused(attn.qkv, attn.q_proj, attn.k_proj, attn.v_proj) is None


def test_training_through_a_fused_model_reaches_the_module_weights(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama3")
    model = load_model(path)
    w = model.model.layers[0].mlp.up_proj.weight.requires_grad_(True)
    ids = torch.tensor([[1, 2, 3, 4]])
    x = model.embed(ids)
    h = model.mlp(0, x)
    h.sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0


@pytest.mark.parametrize("rows", [1, 3, 8, 65, 300])
def test_bf16_packed_product_is_exactly_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g).to(torch.bfloat16)
    b = torch.randn(200, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    assert torch.equal(project(x, w, b), F.linear(x, w, b))
    assert hasattr(w, "_splitstack_onednn") == _ONEDNN_BF16    # packed where oneDNN takes bf16
    assert project(x.view(1, rows, 96), w).shape == (1, rows, 200)
    with torch.no_grad():
        w.mul_(-1.0)                                      # a stale packed copy would miss this
    assert torch.equal(project(x, w), F.linear(x, w))


def test_row_buckets_bound_the_shapes_a_server_sees():
    from models.layers import row_bucket
    assert [row_bucket(m) for m in (1, 7, 16)] == [1, 7, 16]          # decode batches exact
    assert [row_bucket(m) for m in (17, 32, 33, 500, 512, 513)] == [32, 32, 64, 512, 512, 768]
    assert len({row_bucket(m) for m in range(1, 2049)}) == 16 + 16 + 6
