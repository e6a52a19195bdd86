"""Gated delta rule in chunked (WY) form: same result as `naive`, far fewer Python steps.

Per chunk of C tokens with γ = cumsum(g) inside the chunk (all fp32):

    Γ_ij = exp(γ_i − γ_j) for j ≤ i, else 0
    A    = (diag(β) K Kᵀ) ⊙ Γ;   Tinv = (I + strict_lower(A))⁻¹
    U    = Tinv (β ⊙ V);          W = Tinv (β ⊙ e^γ ⊙ K)
    Vn   = U − W S
    O    = (Q ⊙ e^γ) S + ((Q Kᵀ) ⊙ Γ) Vn
    S   ← e^{γ_C} S + (K ⊙ e^{γ_C − γ})ᵀ Vn

Padding the last chunk with k = v = beta = g = 0 changes neither O nor S.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.gated_delta.naive import prepare


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, *, scale=None,
                           use_qk_l2norm: bool = True, chunk_size: int = 64,
                           out_rows: torch.Tensor | None = None):
    """Same contract as `recurrent_gated_delta_rule`. `out_rows` [T] bool: the rows whose
    output is wanted (None: all); chunks holding none of them only advance the state and
    their output rows are left zero (RidgeFill's filled rows need the state, not O)."""
    q, k, v, g, beta = prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = (-t) % c
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (t + pad) // c
    # [B, H, N, C, *]
    q, k, v = (x.view(b, n, c, h, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v))
    g, beta = (x.view(b, n, c, h).permute(0, 3, 1, 2) for x in (g, beta))
    # γ grows to hundreds in strongly decaying heads; in fp32 the differences γ_i − γ_j would
    # lose their low digits to cancellation, so the cumsum and its differences run in fp64.
    gamma = g.double().cumsum(-1)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = decay.exp().to(q.dtype)
    kb = k * beta[..., None]
    a = (kb @ k.transpose(-1, -2)) * decay
    a = a.tril(-1)                                                      # strict lower part
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    tinv_rhs = torch.cat([v * beta[..., None], kb * gamma.exp().to(q.dtype)[..., None]], dim=-1)
    uw = torch.linalg.solve_triangular(eye + a, tinv_rhs, upper=False, unitriangular=True)
    u, w = uw[..., :dv], uw[..., dv:]
    # output terms only for the chunks whose output is wanted (slot[i]: chunk i's row in qk)
    wanted = (torch.arange(n, device=q.device) if out_rows is None else
              F.pad(out_rows, (0, pad)).view(n, c).any(-1).nonzero()[:, 0])
    slot = dict(zip(wanted.tolist(), range(wanted.numel())))
    want = None if out_rows is None else [i in slot for i in range(n)]
    sel = (lambda x: x) if out_rows is None else (lambda x: x[:, :, wanted])  # noqa: E731
    qk = (sel(q) @ sel(k).transpose(-1, -2)) * sel(decay)
    q_decay = sel(q) * sel(gamma).exp().to(q.dtype)[..., None]
    k_decay = k * (gamma[..., -1:] - gamma).exp().to(q.dtype)[..., None]
    s = (q.new_zeros(b, h, dk, dv) if initial_state is None
         else initial_state.to(q.dtype).clone())
    out = q.new_empty(b, h, n, c, dv) if want is None else q.new_zeros(b, h, n, c, dv)
    for i in range(n):
        vn = u[:, :, i] - w[:, :, i] @ s
        if want is None or want[i]:
            j = slot[i]
            out[:, :, i] = q_decay[:, :, j] @ s + qk[:, :, j] @ vn
        s = s * gamma[:, :, i, -1].exp().to(q.dtype)[..., None, None] + k_decay[:, :, i].transpose(-1, -2) @ vn
    out = out.permute(0, 2, 3, 1, 4).reshape(b, n * c, h, dv)[:, :t]
    return out, s
