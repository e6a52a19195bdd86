"""CUDA fast path through the `flash-attn` package (optional GPU extra, imported lazily).

flash-attn already takes GQA and a paged cache (`block_table`) and can return the softmax
lse, so this is a thin adapter to the `naive.attention_lse` contract. Its block size must be
a multiple of 256 for the paged kernel; the engine picks that on CUDA.
"""
from __future__ import annotations

import torch

from kernels.attention.naive import PagedPlan, plan_paged  # noqa: F401  (shared planner)


def _fa():
    import flash_attn  # noqa: F401  (optional GPU extra)
    return flash_attn


def attention_lse(q, k, v, *, kv_lens=None, q_start=None, causal=True, scale=None, mask=None):
    if mask is not None:
        raise NotImplementedError("flash-attn takes lengths, not a boolean mask")
    fa = _fa()
    b, tq, h, d = q.shape
    if q_start is not None and kv_lens is not None and not torch.equal(q_start, kv_lens - tq):
        raise NotImplementedError("flash-attn aligns queries to the end of the keys; "
                                  "q_start must equal kv_lens - Tq")
    if kv_lens is not None or q_start is not None:
        kv_lens = kv_lens if kv_lens is not None else torch.full(
            (b,), k.shape[1], dtype=torch.int32, device=q.device)
        o, lse = fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=kv_lens.to(torch.int32),
                                            softmax_scale=scale, causal=causal,
                                            return_softmax_lse=True)
    else:
        o, lse, _ = fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal,
                                       return_attn_probs=True)
    return o, lse.transpose(1, 2).float()                                # lse [B, H, Tq] -> [B, Tq, H]


def paged_attention_lse(q, k_cache, v_cache, block_tables, kv_lens, q_start=None, *,
                        causal=True, scale=None):
    fa = _fa()
    o, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache,
                                        cache_seqlens=kv_lens.to(torch.int32),
                                        block_table=block_tables.to(torch.int32),
                                        softmax_scale=scale, causal=causal,
                                        return_softmax_lse=True)
    return o, lse.transpose(1, 2).float()


def run_paged(q, k_cache, v_cache, plan: PagedPlan, *, scale=None):
    """flash-attn reads the blocks in place; only the plan's tables and lengths are used."""
    return paged_attention_lse(q, k_cache, v_cache, plan.block_tables, plan.kv_lens,
                               plan.q_start, scale=scale)
