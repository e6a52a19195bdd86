"""Which weights each side of the Q-First split holds (seed 003, §4; docs/design/qfirst.md).

The cache side (attention service) holds Wq, Wo, the attention norms and the q-norm, and
the Gated DeltaNet conv / decay / gated norm / out_proj. The MLP pool holds the embeddings,
every feed-forward, Wk, Wv and the k-norm, the GDN input projections, the final norm and the
LM head. Both sides apply the layer's input norm (the pool to make k, v from z; the cache
side to make q). `keep_side` drops the other side's weights from a loaded model, so a side
that reached for a weight it should not hold would fail at once.
"""
from __future__ import annotations

import torch

from models.model import CausalLM

SIDES = ("attention", "pool")
_ATTENTION = ("input_layernorm", "self_attn.q_proj", "self_attn.o_proj", "self_attn.q_norm",
              "linear_attn.conv1d", "linear_attn.A_log", "linear_attn.dt_bias",
              "linear_attn.norm", "linear_attn.out_proj")
_POOL = ("model.embed_tokens", "input_layernorm", "post_attention_layernorm",
         "self_attn.k_proj", "self_attn.v_proj", "self_attn.k_norm", "linear_attn.in_proj",
         ".mlp.", "model.norm.", "lm_head")


def side_of(name: str) -> set[str]:
    """The sides that hold parameter `name` (a state-dict key)."""
    sides = set()
    if any(part in name for part in _ATTENTION):
        sides.add("attention")
    if any(part in name for part in _POOL):
        sides.add("pool")
    return sides


def keep_side(model: CausalLM, side: str) -> int:
    """Free every parameter `side` does not hold; returns the bytes freed."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    freed = 0
    for name, param in model.named_parameters():
        if side not in side_of(name):
            freed += param.numel() * param.element_size()
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return freed
