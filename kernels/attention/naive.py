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
                  causal: bool = True, scale: float | None = None):
    """q [B, Tq, H, D], k/v [B, Tk, KV, D] -> O [B, Tq, H, D] fp32, lse [B, Tq, H] fp32.

    GQA: KV head j serves query heads j*G .. j*G+G-1. Defaults: kv_lens = Tk and
    q_start = kv_lens - Tq (the queries are the last Tq positions). A row that sees no key
    gets lse = -inf and O = 0.
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
    mask = key_mask(tq, tk, kv_lens, q_start, causal)[:, None, None]
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                  # [B, KV, G, Tq]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("bkgqt,btkd->bqkgd", p, v.float()).reshape(b, tq, h, d)
    return o, lse.permute(0, 3, 1, 2).reshape(b, tq, h)


def gather_paged(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, KV, D], block_tables [B, nb] -> [B, nb*block_size, KV, D]."""
    b, nb = block_tables.shape
    blocks = cache[block_tables.clamp(min=0)]                           # [B, nb, bs, KV, D]
    return blocks.reshape(b, nb * cache.shape[1], *cache.shape[2:])


def paged_attention_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, kv_lens: torch.Tensor,
                        q_start: torch.Tensor | None = None, *, causal: bool = True,
                        scale: float | None = None):
    """Attention over a paged cache.

    q [B, Tq, H, D]; k_cache/v_cache [num_blocks, block_size, KV, D]; block_tables [B, nb]
    (entries past a sequence's last block may be any value, e.g. -1); kv_lens [B] cached
    positions per sequence. Returns (O [B, Tq, H, D] fp32, lse [B, Tq, H] fp32).
    """
    k = gather_paged(k_cache, block_tables)
    v = gather_paged(v_cache, block_tables)
    return attention_lse(q, k, v, kv_lens=kv_lens, q_start=q_start, causal=causal, scale=scale)
