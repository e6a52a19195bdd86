"""Merging partial-softmax aggregates `(O, lse)` (docs/design/qfirst.md).

For disjoint key sets A and B:

    O(A ∪ B)   = lerp(O(B), O(A), sigmoid(lse(A) − lse(B)))
    lse(A ∪ B) = logaddexp(lse(A), lse(B))

The sigmoid form never exponentiates a raw logit, so it stays finite at any magnitude. An
empty shard reports lse = −inf and an arbitrary O (even NaN); it is selected away, never
multiplied by zero.
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """o_* [..., D], lse_* [...] -> (O, lse) of the union. Computed in fp32."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    a_empty, b_empty = lse_a == NEG_INF, lse_b == NEG_INF
    diff = torch.where(a_empty | b_empty, torch.zeros_like(lse_a), lse_a - lse_b)
    w = torch.sigmoid(diff)[..., None]                                  # weight of A
    o_a, o_b = o_a.float(), o_b.float()
    o = torch.lerp(o_b, o_a, w)
    o = torch.where(b_empty[..., None], o_a, torch.where(a_empty[..., None], o_b, o))
    return o, torch.logaddexp(lse_a, lse_b)


def merge_many(parts: list[tuple[torch.Tensor, torch.Tensor]]):
    """Fold any number of shards' `(O, lse)` in the order given."""
    if not parts:
        raise ValueError("merge_many needs at least one (O, lse) pair")
    o, lse = parts[0][0].float(), parts[0][1].float()
    for o_b, lse_b in parts[1:]:
        o, lse = merge(o, lse, o_b, lse_b)
    return o, lse


def combine_current(o_prev: torch.Tensor, lse_prev: torch.Tensor, q: torch.Tensor,
                    k_cur: torch.Tensor, v_cur: torch.Tensor, scale: float | None = None):
    """Fold the current token's own key/value into the cache aggregate.

    o_prev [N, H, D], lse_prev [N, H] (over cached positions < j), q [N, H, D],
    k_cur/v_cur [N, KV, D]. Returns (O, lse) over positions <= j, fp32:

        s_jj = q·k_j / sqrt(D);  w = sigmoid(lse_<j − s_jj);  O = (1 − w) v_j + w O_<j
    """
    n, h, d = q.shape
    kvh = k_cur.shape[1]
    scale = d ** -0.5 if scale is None else scale
    # GQA as views: query head j*G + i reads KV head j, so [N, H] is [N, KV, G]
    k, v = k_cur.float()[:, :, None], v_cur.float()[:, :, None]           # [N, KV, 1, D]
    s_jj = (q.float().reshape(n, kvh, -1, d) * k).sum(-1).mul_(scale)    # [N, KV, G]
    lse_c = lse_prev.float().reshape(s_jj.shape)
    o_c = o_prev.float().reshape(n, kvh, -1, d)
    w = torch.sigmoid(lse_c - s_jj)[..., None]                          # weight of the cache
    o = torch.lerp(v.expand_as(o_c), o_c, w)
    empty = lse_c == NEG_INF
    if empty.any():          # an empty cache's O is arbitrary (even NaN): select it away
        o = torch.where(empty[..., None], v, o)
    return o.reshape(n, h, d), torch.logaddexp(lse_c, s_jj).reshape(n, h)
