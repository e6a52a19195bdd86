"""CPU fast path: PyTorch's fused flash-attention kernel, which also returns the lse.

GQA is folded into the query length (`[B, KV, G*Tq, D]` against `[B, KV, Tk, D]`) so K and V
are never repeated; the mask is repeated G times instead.
"""
from __future__ import annotations

import torch

from kernels.attention.naive import PagedPlan, gather_plan, key_mask, plan_paged

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def attention_lse(q, k, v, *, kv_lens=None, q_start=None, causal=True, scale=None, mask=None):
    """Same contract as `kernels.attention.naive.attention_lse`; O is returned in q's dtype."""
    b, tq, h, d = q.shape
    tk, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    scale = d ** -0.5 if scale is None else scale
    # the fused kernel silently misreads inputs whose last dim is strided (as a transposed
    # projection output is), so those are copied first
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if causal and mask is None and kv_lens is None and q_start is None and tq == tk:
        # a plain causal prompt: let the kernel skip the masked half (is_causal needs the
        # query and key rows aligned, so K/V are repeated to the query heads instead)
        kk = k.repeat_interleave(g, dim=2).transpose(1, 2)
        vv = v.repeat_interleave(g, dim=2).transpose(1, 2)
        o, lse = _flash(q.transpose(1, 2), kk, vv, 0.0, True, scale=scale)
        return o.transpose(1, 2), lse.transpose(1, 2).float()
    qg = q.reshape(b, tq, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * tq, d)
    kk, vv = k.transpose(1, 2), v.transpose(1, 2)
    if mask is None and not (kv_lens is None and (not causal or tq == 1)):
        if kv_lens is None:
            kv_lens = torch.full((b,), tk, dtype=torch.long, device=q.device)
        if q_start is None:
            q_start = kv_lens - tq
        mask = key_mask(tq, tk, kv_lens, q_start, causal)                # [B, Tq, Tk]
    additive = None
    if mask is not None:
        additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
        additive.masked_fill_(~mask, float("-inf"))
        additive = additive[:, None].expand(b, g, tq, tk).reshape(b, 1, g * tq, tk)
    o, lse = _flash(qg, kk, vv, 0.0, False, attn_mask=additive, scale=scale)
    o = o.view(b, kvh, g, tq, d).permute(0, 3, 1, 2, 4).reshape(b, tq, h, d)
    lse = lse.view(b, kvh, g, tq).permute(0, 3, 1, 2).reshape(b, tq, h)
    return o, lse.float()


def run_paged(q, k_cache, v_cache, plan: PagedPlan, *, scale=None):
    return attention_lse(q, gather_plan(k_cache, plan), gather_plan(v_cache, plan),
                         mask=plan.mask, scale=scale)


def paged_attention_lse(q, k_cache, v_cache, block_tables, kv_lens, q_start=None, *,
                        causal=True, scale=None):
    plan = plan_paged(block_tables, kv_lens, k_cache.shape[1], q.shape[1], q_start, causal)
    return run_paged(q, k_cache, v_cache, plan, scale=scale)
