"""Reference attention that returns the partial-softmax aggregate `(O, lse)`.

Readable fp32 code; every fast path in this folder is tested against it.

Key positions are absolute: query row `i` of sequence `b` sits at position
`q_start[b] + i` and may see key `j` iff `j < kv_lens[b]` and (if causal) `j <= q_start[b] + i`.

    keys   0 1 2 3 4 5 6 7 . .      kv_lens[b] = 8, q_start[b] = 5, Tq = 3
    q 5    x x x x x x . .
    q 6    x x x x x x x .
    q 7    x x x x x x x x
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def key_mask(tq: int, tk: int, kv_lens: torch.Tensor, q_start: torch.Tensor,
             causal: bool) -> torch.Tensor:
    """Boolean mask [B, Tq, Tk], True where a query may attend a key."""
    keys = torch.arange(tk, device=kv_lens.device)
    mask = keys[None, None, :] < kv_lens[:, None, None]
    if causal:
        qpos = q_start[:, None] + torch.arange(tq, device=kv_lens.device)[None, :]
        mask = mask & (keys[None, None, :] <= qpos[:, :, None])
    return mask


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  kv_lens: torch.Tensor | None = None, q_start: torch.Tensor | None = None,
                  causal: bool = True, scale: float | None = None,
                  mask: torch.Tensor | None = None):
    """q [B, Tq, H, D], k/v [B, Tk, KV, D] -> O [B, Tq, H, D] fp32, lse [B, Tq, H] fp32.

    GQA: KV head j serves query heads j*G .. j*G+G-1. Defaults: kv_lens = Tk and
    q_start = kv_lens - Tq (the queries are the last Tq positions). A precomputed boolean
    `mask` [B, Tq, Tk] (from `key_mask`) replaces kv_lens / q_start / causal. A row that sees
    no key gets lse = -inf and O = 0.
    """
    b, tq, h, d = q.shape
    tk, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    scale = d ** -0.5 if scale is None else scale
    if kv_lens is None:
        kv_lens = torch.full((b,), tk, dtype=torch.long, device=q.device)
    if q_start is None:
        q_start = kv_lens - tq
    qf = q.float().view(b, tq, kvh, g, d)
    s = torch.einsum("bqkgd,btkd->bkgqt", qf, k.float()) * scale     # [B, KV, G, Tq, Tk]
    if mask is None:
        mask = key_mask(tq, tk, kv_lens, q_start, causal)
    s = s.masked_fill(~mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                  # [B, KV, G, Tq]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("bkgqt,btkd->bqkgd", p, v.float()).reshape(b, tq, h, d)
    return o, lse.permute(0, 3, 1, 2).reshape(b, tq, h)


@dataclass
class PagedPlan:
    """Per-step view of a paged cache, built once and reused by every layer.

    gather: [B, L] flat cache slots (block * block_size + offset) of each sequence's first
    L = max(kv_lens) positions (padding points at slot 0); mask: [B, Tq, L] allowed keys.
    """
    gather: torch.Tensor
    mask: torch.Tensor
    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    q_start: torch.Tensor
    runs: list | None = None     # backends reading blocks in place cache their layout here
    native: object | None = None  # cpu_paged.Prepared of a decode batch (cpu_flash)


def plan_paged(block_tables: torch.Tensor, kv_lens: torch.Tensor, block_size: int, tq: int,
               q_start: torch.Tensor | None = None, causal: bool = True) -> PagedPlan:
    """block_tables [B, nb] (entries past a sequence's blocks may be -1), kv_lens [B]."""
    q_start = kv_lens - tq if q_start is None else q_start
    length = int(kv_lens.max()) if kv_lens.numel() else 0
    pos = torch.arange(length, device=kv_lens.device)
    blocks = block_tables[:, pos // block_size].clamp(min=0)
    gather = blocks * block_size + pos % block_size
    mask = key_mask(tq, length, kv_lens, q_start, causal)
    return PagedPlan(gather, mask, block_tables, kv_lens, q_start)


def gather_plan(cache: torch.Tensor, plan: PagedPlan) -> torch.Tensor:
    """cache [num_blocks, block_size, KV, D] -> [B, L, KV, D]."""
    flat = cache.view(-1, *cache.shape[2:])
    rows = torch.index_select(flat, 0, plan.gather.reshape(-1))   # ~1.7x advanced indexing
    return rows.view(*plan.gather.shape, *cache.shape[2:])


def run_paged(q, k_cache, v_cache, plan: PagedPlan, *, scale=None):
    return attention_lse(q, gather_plan(k_cache, plan), gather_plan(v_cache, plan),
                         mask=plan.mask, scale=scale)


def paged_attention_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, kv_lens: torch.Tensor,
                        q_start: torch.Tensor | None = None, *, causal: bool = True,
                        scale: float | None = None):
    """Attention over a paged cache.

    q [B, Tq, H, D]; k_cache/v_cache [num_blocks, block_size, KV, D]; block_tables [B, nb]
    (entries past a sequence's last block may be any value, e.g. -1); kv_lens [B] cached
    positions per sequence. Returns (O [B, Tq, H, D] fp32, lse [B, Tq, H] fp32).
    """
    plan = plan_paged(block_tables, kv_lens, k_cache.shape[1], q.shape[1], q_start, causal)
    return run_paged(q, k_cache, v_cache, plan, scale=scale)
