"""CPU fast path: PyTorch's fused flash-attention kernel, which also returns the lse.

GQA is folded into the query length (`[B, KV, G*Tq, D]` against `[B, KV, Tk, D]`) so K and V
are never repeated; the mask is repeated G times instead.
"""
from __future__ import annotations

import torch

from kernels.attention.naive import gather_paged, key_mask

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def attention_lse(q, k, v, *, kv_lens=None, q_start=None, causal=True, scale=None):
    """Same contract as `kernels.attention.naive.attention_lse`; O is returned in q's dtype."""
    b, tq, h, d = q.shape
    tk, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    scale = d ** -0.5 if scale is None else scale
    # the fused kernel silently misreads inputs whose last dim is strided (as a transposed
    # projection output is), so those are copied first
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    qg = q.reshape(b, tq, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * tq, d)
    kk, vv = k.transpose(1, 2), v.transpose(1, 2)
    if kv_lens is None and (not causal or tq == 1):
        mask = None
    else:
        if kv_lens is None:
            kv_lens = torch.full((b,), tk, dtype=torch.long, device=q.device)
        if q_start is None:
            q_start = kv_lens - tq
        allowed = key_mask(tq, tk, kv_lens, q_start, causal)            # [B, Tq, Tk]
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        mask.masked_fill_(~allowed, float("-inf"))
        mask = mask[:, None].expand(b, g, tq, tk).reshape(b, 1, g * tq, tk)
    o, lse = _flash(qg, kk, vv, 0.0, False, attn_mask=mask, scale=scale)
    o = o.view(b, kvh, g, tq, d).permute(0, 3, 1, 2, 4).reshape(b, tq, h, d)
    lse = lse.view(b, kvh, g, tq).permute(0, 3, 1, 2).reshape(b, tq, h)
    return o, lse.float()


def paged_attention_lse(q, k_cache, v_cache, block_tables, kv_lens, q_start=None, *,
                        causal=True, scale=None):
    k = gather_paged(k_cache, block_tables)
    v = gather_paged(v_cache, block_tables)
    return attention_lse(q, k, v, kv_lens=kv_lens, q_start=q_start, causal=causal, scale=scale)
