"""Full-attention block weights and the projection stages around the attention sweep.

The sweep itself (`kernels.attention`) is not here: who holds the keys (a dense prompt, the
engine's paged cache, a remote attention shard) is the caller's business. This module only
turns a normalised hidden state into q / k / v and the attention output back into the stream.
"""
from __future__ import annotations

import torch
from torch import nn

from models.config import ModelConfig
from models.layers import Fused, Linear, RMSNorm, fuse_linears, project, still_fused


class FullAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, d)
        self.output_gate = cfg.attn_output_gate
        q_out = self.num_heads * d * (2 if self.output_gate else 1)
        self.q_proj = Linear(h, q_out, bias=cfg.attention_bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.zero_centered_norm)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.zero_centered_norm)
        else:
            self.q_norm = self.k_norm = None
        self.qkv: Fused | None = None

    def fuse(self) -> None:
        """Store q, k and v as row blocks of one matrix (`layers.fuse_linears`): `project`
        then runs one product for all three, and `key_value` one for k and v."""
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def project(self, xn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary):
        """`query` and `key_value` of the same xn -> (q, gate, k, v), one product when fused."""
        fused = still_fused(self.qkv, self.q_proj, self.k_proj, self.v_proj)
        if fused is None:
            q, gate = self.query(xn, cos, sin, rotary)
            return (q, gate, *self.key_value(xn, cos, sin, rotary))
        q, k, v = project(xn, fused.weight, fused.bias).split(fused.sizes, dim=-1)
        return (*self._query(q, cos, sin, rotary), *self._key_value(k, v, cos, sin, rotary))

    def query(self, xn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary):
        """xn [*, h] (already normed) -> q [*, H, D] (normed, rotated), gate [*, H·D] or None."""
        return self._query(self.q_proj(xn), cos, sin, rotary)

    def _query(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary):
        lead = q.shape[:-1]
        gate = None
        if self.output_gate:
            qg = q.view(*lead, self.num_heads, 2 * self.head_dim)
            q, gate = qg[..., :self.head_dim], qg[..., self.head_dim:].reshape(*lead, -1)
        else:
            q = q.view(*lead, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return rotary.apply(q, cos, sin), gate

    def key_value(self, xn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary):
        """xn [*, h] -> k, v [*, KV, D]; k is normed and rotated, as stored in the KV cache."""
        fused = still_fused(self.qkv, self.q_proj, self.k_proj, self.v_proj)
        if fused is None:
            return self._key_value(self.k_proj(xn), self.v_proj(xn), cos, sin, rotary)
        k, v = project(xn, *fused.rest).split(fused.sizes[1:], dim=-1)
        return self._key_value(k, v, cos, sin, rotary)

    def _key_value(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   rotary):
        lead = k.shape[:-1]
        k = k.reshape(*lead, self.num_kv_heads, self.head_dim)
        v = v.reshape(*lead, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return rotary.apply(k, cos, sin), v

    def output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """o [*, H, D] -> [*, h] (before the residual add)."""
        o = o.reshape(*o.shape[:-2], -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)
