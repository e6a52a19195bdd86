"""Gated delta rule, token-by-token reference (the oracle for the chunked form).

Shapes: q, k [B, T, HV, Dk] (already repeated to the value heads), v [B, T, HV, Dv],
g, beta [B, T, HV], state [B, HV, Dk, Dv]. Everything runs in fp32:

    S   = exp(g_t) · S
    u   = beta_t · (v_t − Sᵀ k_t)
    S   = S + k_t uᵀ
    o_t = Sᵀ q_t
"""
from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    acc = torch.promote_types(q.dtype, torch.float32)       # fp32, or fp64 for fp64 inputs
    q, k, v, g, beta = (t.to(acc) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, *, scale=None,
                               use_qk_l2norm: bool = True):
    """Returns (o [B, T, HV, Dv] fp32, final_state [B, HV, Dk, Dv] fp32)."""
    q, k, v, g, beta = prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    s = (q.new_zeros(b, h, dk, dv) if initial_state is None
         else initial_state.to(q.dtype).clone())
    out = q.new_empty(b, t, h, dv)
    for i in range(t):
        s = s * g[:, i].exp()[..., None, None]
        kv_mem = (s * k[:, i, :, :, None]).sum(-2)                       # [B, HV, Dv]
        u = (v[:, i] - kv_mem) * beta[:, i, :, None]
        s = s + k[:, i, :, :, None] * u[:, :, None, :]
        out[:, i] = (s * q[:, i, :, :, None]).sum(-2)
    return out, s
