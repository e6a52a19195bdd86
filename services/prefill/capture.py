"""The exact model's per-layer inputs, composed from the stage API.

    layer_inputs(model, ids) -> [x_0, x_1, ..., x_L]     x_l [N, hidden] = input of layer l

`x_L` is the last layer's output (before the final norm). Calibration reads `x_S` and the
upper `x_l`; the splice diagnostic reads the exact keys and values of every layer.
"""
from __future__ import annotations

import torch

from kernels.attention import get_backend
from models.config import FULL_ATTENTION
from models.model import CausalLM


@torch.inference_mode()
def exact_pass(model: CausalLM, ids: torch.Tensor, *, keep_inputs=True, keep_kv=False):
    """ids [N] -> (inputs: list of L+1 [N, h] or None, kv: {l: (k, v)} for FA layers)."""
    backend = get_backend(None, model.device)
    positions = torch.arange(ids.shape[0], device=ids.device)
    x, h = model.embed(ids), None
    inputs, kv = ([x] if keep_inputs else None), {}
    for l, layer in enumerate(model.model.layers):
        if layer.kind == FULL_ATTENTION:
            a = model.attn_inputs(l, x, positions, u=h)
            if keep_kv:
                kv[l] = (a.k, a.v)
            o, _ = backend.attention_lse(a.q[None], a.k[None], a.v[None], causal=True)
            h = model.attn_output(l, x, o[0], a.gate)
        else:
            inp = model.gdn_inputs(l, x)
            o, _, _ = model.gdn_mix(l, type(inp)(*(t[None] for t in inp)))
            h = model.gdn_output(l, x, o[0], inp.z)
        x = model.mlp(l, h)
        if keep_inputs:
            inputs.append(x)
    return inputs, kv
