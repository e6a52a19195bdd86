"""CPU fast path: PyTorch's fused flash-attention kernel, which also returns the lse.

GQA is folded into the query length (`[B, KV, G*Tq, D]` against `[B, KV, Tk, D]`) so K and V
are never repeated; the mask is repeated G times instead.

Decode rows (Tq = 1) of a paged cache see a prefix of their block table. `run_paged` sends
a decode batch to the native kernel of `cpu_paged`: one call per layer for the whole batch,
reading the blocks in place. Without it, `run_paged` reads each stretch of consecutive block
ids ("run") in place and merges the runs' `(O, lse)` (`segments_lse`), instead of gathering
every key into a copy first (except for a small batch, `GATHER_KEYS`, where one call over a
gathered copy costs less than a call per run):

    table  [7 8 9 | 3 | 12 13]   kv_len 90, block_size 16  ->  runs (7, 48) (3, 16) (12, 26)
"""
from __future__ import annotations

import torch

from kernels.attention import cpu_paged
from kernels.attention.naive import PagedPlan, gather_plan, key_mask, plan_paged
from kernels.merge import merge

MAX_RUNS = 16       # a table more fragmented than this is gathered instead
GATHER_KEYS = 2048  # a decode batch (B > 1) whose padded keys B·L are at most this many is
                    # gathered and swept in one call: at B = 8, L = 160 that is ~1.6x faster
                    # than a call per run, at L = 512 even, at L = 2048 2.4x slower (measured)

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


def segments_lse(q, segments, *, scale=None):
    """q [Tq, H, D] attending to every key of `segments`, pairs of K, V [T_i, KV, D] (any
    strides but the last: views of a paged cache), merged over segments.
    Returns (O [Tq, H, D] fp32, lse [Tq, H] fp32); no segment gives lse = −inf, O = 0."""
    o = lse = None
    for k, v in segments:
        o_s, lse_s = attention_lse(q[None], k[None], v[None], causal=False, scale=scale)
        o_s, lse_s = o_s[0].float(), lse_s[0]
        o, lse = (o_s, lse_s) if o is None else merge(o, lse, o_s, lse_s)
    if o is None:
        return torch.zeros(q.shape), torch.full(q.shape[:2], float("-inf"))
    return o, lse


def block_runs(table: list[int], num_keys: int, block_size: int) -> list[tuple[int, int]]:
    """(first block id, keys) of each run of consecutive block ids holding keys [0, num_keys)."""
    runs: list[tuple[int, int]] = []
    for j in range(-(-num_keys // block_size)):
        keys = min(block_size, num_keys - j * block_size)
        if runs and runs[-1][0] + runs[-1][1] // block_size == table[j] \
                and runs[-1][1] % block_size == 0:
            runs[-1] = (runs[-1][0], runs[-1][1] + keys)
        else:
            runs.append((table[j], keys))
    return runs


def run_paged(q, k_cache, v_cache, plan: PagedPlan, *, scale=None):
    if q.shape[1] == 1 and cpu_paged.supports(q, k_cache, k_cache.shape[2], k_cache.shape[3]):
        if plan.native is None:           # once per step; every layer reuses it
            plan.native = cpu_paged.prepare(plan.block_tables, plan.mask[:, 0].sum(-1),
                                            k_cache.shape[1], q.shape[2], q.shape[3])
        o, lse = cpu_paged.decode(q[:, 0], k_cache, v_cache, scale=scale, prepared=plan.native)
        return o[:, None], lse[:, None]
    if q.shape[1] != 1 or q.device.type != "cpu" \
            or (q.shape[0] > 1 and plan.gather.numel() <= GATHER_KEYS):
        o, lse = attention_lse(q, gather_plan(k_cache, plan), gather_plan(v_cache, plan),
                               mask=plan.mask, scale=scale)
        empty = ~plan.mask.any(-1)                      # [B, Tq]: rows that see no key
        if bool(empty.any()):
            o = o.masked_fill(empty[..., None, None], 0.0)
            lse = lse.masked_fill(empty[..., None], float("-inf"))
        return o, lse
    bs = k_cache.shape[1]
    if plan.runs is None:             # once per step; every layer reuses it
        lens = plan.mask[:, 0].sum(-1).tolist()       # a decode row sees a prefix
        plan.runs = [block_runs(t, n, bs) for t, n in zip(plan.block_tables.tolist(), lens)]
    k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)      # [slots, KV, D]
    o = torch.empty(q.shape, dtype=torch.float32)
    lse = torch.empty(q.shape[:3])
    for b, runs in enumerate(plan.runs):
        if len(runs) > MAX_RUNS:
            n = sum(keys for _, keys in runs)
            idx = plan.gather[b, :n]
            segments = [(k_flat[idx], v_flat[idx])]
        else:
            segments = [(k_flat[first * bs:first * bs + keys], v_flat[first * bs:first * bs + keys])
                        for first, keys in runs]
        o[b], lse[b] = segments_lse(q[b], segments, scale=scale)
    return o, lse


def paged_attention_lse(q, k_cache, v_cache, block_tables, kv_lens, q_start=None, *,
                        causal=True, scale=None):
    plan = plan_paged(block_tables, kv_lens, k_cache.shape[1], q.shape[1], q_start, causal)
    return run_paged(q, k_cache, v_cache, plan, scale=scale)
