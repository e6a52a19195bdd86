"""RidgeFill's selectors: which prefix rows (of 0..P−1) still run every layer exactly.

    attention       attention the last `query_rows` rows give each key below the split
    question-blind  the same from the `query_rows` rows just before the tail
    protected       the rarest 25% of each token class (calibration unigram counts)
    probe           two sweeps: the last `probe_rows` rows run the upper layers over the
                    fully filled prefix and rank prefix rows by the attention they receive;
                    with `lexical` > 0 the lexical net's sentences come first (seed 000)
    random          a seeded random sample of the same count (the control)

Each returns sorted row indices, at most the budget (`FillSettings.budget_rows`) except for
the probe's special-token rows, which sit outside it. `FillMemo` keeps the probe sweep's
filled-row projections for the fill's own pass to reuse.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch

from models.gdn import GDNInputs
from services.prefill.lexicon import Lexicon
from services.prefill.settings import FillSettings


class RowSource(Protocol):
    """What the selectors read of the fill whose rows they choose (a `RidgeFill`)."""
    unigram: torch.Tensor | None          # calibration unigram counts (`protected`)
    token_class: torch.Tensor | None
    lexicon: Lexicon | None               # the probe's lexical net

    def sweep(self, s: FillSettings, x_split: torch.Tensor, rows: torch.Tensor,
              filled: torch.Tensor, p: int, collect, memo: FillMemo | None = None) -> None:
        """The probe's sweep of the upper layers over the filled prefix."""


def select_rows(fill: RowSource, s: FillSettings, ids: torch.Tensor, p: int,
                scorer: AttentionScorer | None, x_split: torch.Tensor, positions: torch.Tensor,
                memo: FillMemo | None = None) -> torch.Tensor:
    """The exact prefix rows under `s.selector`. `scorer` has watched the lower layers
    (attention, question-blind); `x_split` [N, h] feeds the probe's sweep."""
    budget = s.budget_rows(p)
    dev = ids.device
    empty = torch.zeros(0, dtype=torch.long, device=dev)
    if s.selector == "none" or budget == 0 or p == 0:
        return empty
    if s.selector == "random":
        g = torch.Generator().manual_seed(s.seed)
        return torch.randperm(p, generator=g)[:budget].sort().values.to(dev)
    if s.selector in ("attention", "question-blind"):
        scores = scorer.scores[:p]
    elif s.selector == "protected":
        return protected_rows(fill.unigram, fill.token_class, ids[:p], budget)
    else:                                                       # probe (two sweeps)
        scores = probe_scores(fill, s, x_split, positions, p, memo)
        if s.lexical > 0:         # `RidgeFill.check` made sure there is a lexicon
            return lexical_rows(fill.lexicon, s, ids, p, budget, scores)
    return torch.topk(scores, min(budget, p)).indices.sort().values


def lexical_rows(lexicon, s: FillSettings, ids: torch.Tensor, p: int, budget: int,
                 scores: torch.Tensor) -> torch.Tensor:
    """The probe's rows with its lexical net (seed 000): the nominated sentences' rows
    first, up to `lexical`·P of the budget, the rest of the budget by the probe's
    attention; the prefix's special tokens on top, outside the budget."""
    ids_list = ids.tolist()
    lex = lexicon.net(ids_list, p, min(budget, int(round(s.lexical * p))), rank=s.lexical_rank)
    special = lexicon.special_rows(ids_list, p)
    lex_rows = torch.tensor(lex, dtype=torch.long, device=scores.device)
    ranked = scores.clone()
    ranked[lex_rows] = float("-inf")
    rest = torch.topk(ranked, min(budget, p) - lex_rows.numel()).indices
    extra = torch.tensor(special, dtype=torch.long, device=scores.device)
    return torch.unique(torch.cat([lex_rows, rest, extra]))


def protected_rows(unigram: torch.Tensor, token_class: torch.Tensor,
                   prefix_ids: torch.Tensor, budget: int) -> torch.Tensor:
    """The rarest 25% of each token class (add-one calibration frequency), capped at
    the budget by rarity."""
    freq = (unigram.to(prefix_ids.device)[prefix_ids] + 1.0)
    cls = token_class.to(prefix_ids.device)[prefix_ids]
    chosen = []
    for c in range(1, int(token_class.max()) + 1):
        rows = (cls == c).nonzero()[:, 0]
        if rows.numel():
            k = max(1, math.ceil(0.25 * rows.numel()))
            chosen.append(rows[torch.topk(-freq[rows], k).indices])
    if not chosen:
        return torch.zeros(0, dtype=torch.long, device=prefix_ids.device)
    rows = torch.cat(chosen)
    if rows.numel() > budget:
        rows = rows[torch.topk(-freq[rows], budget).indices]
    return rows.sort().values


def probe_scores(fill: RowSource, s: FillSettings, x_split: torch.Tensor,
                 positions: torch.Tensor, p: int, memo: FillMemo | None = None) -> torch.Tensor:
    """Sweep 1: the last `probe_rows` rows run the exact upper layers over the fully
    filled prefix (GDN from an empty state); rank prefix rows by the attention they
    receive -> [P]. With `memo`, the filled rows' K/V and GDN inputs are kept for sweep 2."""
    n = x_split.shape[0]
    rows = positions[max(0, n - s.probe_rows):]
    # every row before the probe's is filled in this sweep, tail rows included (with
    # fewer probe rows than tail rows, rows p..n−probe_rows are neither prefix nor probe)
    before = positions[:int(rows[0])]
    scores = torch.zeros(n, device=x_split.device)

    def collect(l, q, k, mask):
        scores.add_(attention_received(q, k, mask))

    fill.sweep(s, x_split, rows, before, p, collect, memo)
    if memo is not None:
        memo.recording = False
    return scores[:p]


class FillMemo:
    """The probe sweep's filled-row projections per upper layer: K/V for attention layers,
    GDN inputs for Gated DeltaNet layers, of rows 0..r−1 (the probe fills every prefix row
    before its own). Both sweeps fill from the same x_S, so the second sweep takes its
    filled rows (a subset, when all lie below r) from here instead of recomputing the
    map and projections."""

    def __init__(self):
        self.layers: dict[int, tuple] = {}
        self.recording = True


def memo_get(memo: FillMemo | None, l: int, filled: torch.Tensor, compute):
    """compute() -> a tuple of [len(filled), ...] tensors (or None entries) for the sorted
    `filled` rows; recorded while the probe runs, then indexed where it covers them."""
    if memo is None:
        return compute()
    if memo.recording:
        memo.layers[l] = out = compute()
        return out
    hit = memo.layers.get(l)
    if hit is None or (filled.numel() and int(filled[-1]) >= hit[0].shape[0]):
        return compute()
    rows = [None if t is None else t[filled] for t in hit]
    return type(hit)(*rows) if isinstance(hit, GDNInputs) else tuple(rows)


class AttentionScorer:
    """Attention the selector's query rows give every key at sub-split attention layers
    (layers l with (l+1) % 4 == 0, else every attention layer below the split); the
    lower layers feed it through `add`."""

    def __init__(self, config, s: FillSettings, n: int, p: int):
        fa = [l for l in config.full_attention_layers if l < s.split]
        self.layers = set([l for l in fa if (l + 1) % 4 == 0] or fa)
        if s.selector == "attention":
            lo = max(0, n - s.query_rows)
        else:                       # question-blind: the rows just before the tail
            lo = max(0, p - s.query_rows)
        self.rows = torch.arange(lo, n if s.selector == "attention" else p)
        self.scores = torch.zeros(n)

    def add(self, l, q, k):
        if l not in self.layers or not self.rows.numel():
            return
        n = k.shape[0]
        rows = self.rows.to(q.device)
        mask = torch.arange(n, device=q.device)[None, :] <= rows[:, None]
        self.scores = self.scores.to(q.device) + attention_received(q[rows], k, mask)


def attention_received(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [Q, H, D], k [N, KV, D], mask [Q, N] -> [N]: softmax attention summed over heads
    and queries."""
    h, kvh, d = q.shape[1], k.shape[1], q.shape[2]
    qf = q.float().view(q.shape[0], kvh, h // kvh, d)
    sc = torch.einsum("qkgd,nkd->kgqn", qf, k.float()) * d ** -0.5
    sc = sc.masked_fill(~mask[None, None], float("-inf"))
    return torch.softmax(sc, dim=-1).nan_to_num(0.0).sum(dim=(0, 1, 2))
