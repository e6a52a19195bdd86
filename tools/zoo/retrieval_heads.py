"""Which of the parent's attention heads copy from a needle, and so which layers a hybrid keeps.

A head retrieves (Wu et al., "Retrieval Head Mechanistically Explains Long-Context
Factuality", 2024) when, at a step that writes a token the prompt holds earlier, its
attention lands on that earlier token. On retrieval items of the train family
(`derive.needle_batch`, calibration text) the parent answers by copying; at every answer
position t whose next token also occurs before the answer, each head's softmax mass on
those earlier occurrences is its copy score at t. `copy_scores` averages it per
(layer, head) over the items.

`choose_layers` turns the scores into a hybrid layout: the `num_retrieval` layers with the
best copying heads keep full attention (the Gated DeltaNet that would replace them has no
softmax to point with), and the rest of the attention budget goes to the every-fourth-layer
positions (Qwen3.5's rule) from the bottom up, so the lower layers keep some exact mixing
too. On SmolLM2-135M five layers stand out, 17, 18, 20, 21 and 23 (best head 0.19-0.67 of
the attention mass on the copied token; every other layer at most 0.17, most under 0.05);
Qwen3.5's own rule keeps 3, 7, ..., 27, which replaces all of them but 23.

`induction_scores` measures copying with no task format at all, on any model, hybrids
included (Olsson et al., "In-context Learning and Induction Heads", 2022): a run of random
tokens repeated once; in the second copy, an induction head attends from each token to the
token after its first occurrence, a previous-token head to the token just before it. On
SmolLM2-135M the induction heads sit in layers 17 (0.84), 18 (0.93), 20 and 23, and the
strongest previous-token heads in layers 1, 2, 11, 16 (0.91) and 19. The same run on random
hex characters (a UUID's alphabet, one token each in SmolLM2) asks for matching on more
than one previous token, and the top-1 accuracy of the next token over the second copy says
whether the model really copies. `ablated` zeroes chosen heads' outputs, so a head's part in
copying is measured by removing it: in SmolLM2, head 16:0 (previous-token) carries the
circuit (copy accuracy 0.68 -> 0.01 on word pieces), and layers 19, 20 and 23 after the
induction heads matter too (each ablated whole: 0.18-0.25), where layers 3, 11, 21 and 22
do not (0.57-0.68).
"""
from __future__ import annotations

import random
from contextlib import contextmanager
from typing import NamedTuple

import torch

from models.config import FULL_ATTENTION
from models.model import CausalLM
from tools.zoo.hybrid_init import attention_logprobs, train_logits


@torch.inference_mode()
def copy_scores(parent: CausalLM, items: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[torch.Tensor, int]:
    """items: (ids [1, T], answer mask [T]) as `derive.needle_batch` makes them ->
    (mean copy mass [layers, heads], number of copy steps scored)."""
    cfg = parent.config
    if any(kind != FULL_ATTENTION for kind in cfg.layer_types):
        raise ValueError("copy scores are measured on an all-attention parent")
    total = torch.zeros(cfg.num_hidden_layers, cfg.num_attention_heads)
    steps = 0
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    for ids, mask in items:
        ids = ids[0]
        t = len(ids)
        rows = mask.nonzero()[:, 0]
        rows = rows[rows + 1 < t]
        if len(rows) == 0:
            continue
        before = int(rows[0]) + 1          # the answer starts here; sources lie before it
        sources = [(ids[:before - 1] == ids[r + 1]).nonzero()[:, 0] for r in rows.tolist()]
        kept = [j for j, s in enumerate(sources) if len(s)]
        steps += len(kept)
        pos = torch.arange(t)[None]
        x, h = parent.embed(ids[None]), None
        for l in range(cfg.num_hidden_layers):
            a = parent.attn_inputs(l, x, pos, u=h)
            q = a.q[0, rows].float()                                       # [R, H, D]
            k = a.k[0].float().repeat_interleave(group, dim=1)             # [T, H, D]
            scores = torch.einsum("rhd,thd->hrt", q, k) * cfg.head_dim ** -0.5
            causal = torch.arange(t)[None, :] <= rows[:, None]
            probs = scores.masked_fill(~causal[None], float("-inf")).softmax(-1)   # [H, R, T]
            for j in kept:
                total[l] += probs[:, j, sources[j]].sum(-1)
            o = torch.nn.functional.scaled_dot_product_attention(
                a.q.transpose(1, 2), a.k.transpose(1, 2), a.v.transpose(1, 2), is_causal=True,
                enable_gqa=True).transpose(1, 2)
            h = parent.attn_output(l, x, o, a.gate)
            x = parent.mlp(l, h)
    return total / max(1, steps), steps


def train_items(tok, n: int, seq_len: int, seed: int = 0) -> list:
    """n retrieval items of the train family on calibration text (never the eval's text or
    the held-out formats)."""
    from evals.corpus import documents, haystack_text
    from tools.zoo.derive import needle_batch

    filler = tok(haystack_text(documents("calib")), add_special_tokens=False)["input_ids"]
    rng = random.Random(f"retrieval-heads-{seed}")
    return [needle_batch(tok, filler, seq_len, rng) for _ in range(n)]


def choose_layers(scores: torch.Tensor, num_fa: int, num_retrieval: int = 5,
                  interval: int = 4, phase: int = 3) -> list[int]:
    """The layers that keep attention: the `num_retrieval` layers whose best head scores
    highest (layers with no copy mass at all never count), then i % interval == phase from
    the bottom until there are num_fa."""
    best = scores.max(-1).values
    retrieval = [int(l) for l in best.argsort(descending=True, stable=True) if best[l] > 0]
    chosen = set(retrieval[:min(num_retrieval, num_fa)])
    for l in range(phase, scores.shape[0], interval):
        if len(chosen) >= num_fa:
            break
        chosen.add(l)
    return sorted(chosen)


class Induction(NamedTuple):
    induction: torch.Tensor      # [layers, heads], NaN where a layer has no softmax attention
    previous: torch.Tensor       # the same, previous-token mass
    copy: float                  # top-1 accuracy of the next token over the second copy


# A UUID's alphabet. SmolLM2 writes each of these characters as its own token, so a run of
# them repeats every short n-gram: copying it needs a head that matches more than one
# previous token, where a run of random word pieces can be copied from one.
HEX = "0123456789abcdef"


def single_char_ids(tok, chars: str = HEX) -> torch.Tensor:
    """The token ids of `chars`, each a token of its own in `tok`'s vocabulary."""
    ids = [tok.convert_tokens_to_ids(c) for c in chars]
    if any(i is None or i == tok.unk_token_id for i in ids):
        raise ValueError(f"not every one of {chars!r} is a token of its own")
    return torch.tensor(ids)


@torch.inference_mode()
def induction_scores(model: CausalLM, n: int = 200, seed: int = 0,
                     alphabet: torch.Tensor | None = None) -> Induction:
    """The mean attention, over the second copy of `n` random tokens repeated, on the token
    after the current token's first occurrence (induction) and on the token just before it
    (previous-token), per (layer, head), and how often the model's top-1 next token is the
    one the first copy says. Token ids are drawn from `alphabet` if given, else from
    [1000, 40000) (ordinary words and pieces, not SmolLM2's special tokens) within the
    vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    if alphabet is None:
        hi = min(40000, model.config.vocab_size)
        seq = torch.randint(min(1000, hi // 10), hi, (n,), generator=gen)
    else:
        seq = alphabet[torch.randint(0, len(alphabet), (n,), generator=gen)]
    ids = torch.cat([seq, seq])[None]
    qk = dict.fromkeys(range(model.config.num_hidden_layers))
    logits = train_logits(model, ids, attn=qk)
    copy = (logits[0, n:2 * n - 1].argmax(-1) == ids[0, n + 1:]).float().mean().item()
    heads = model.config.num_attention_heads
    induction = torch.full((len(qk), heads), float("nan"))
    previous = induction.clone()
    rows = torch.arange(n + 1, 2 * n)
    for l, pair in qk.items():
        if pair is not None:
            p = attention_logprobs(*pair).exp()                              # [H, T, T]
            induction[l] = p[:, rows, rows - n + 1].mean(-1)
            previous[l] = p[:, rows, rows - 1].mean(-1)
    return Induction(induction, previous, copy)


@contextmanager
def ablated(model: CausalLM, heads: list[tuple[int, int | None]]):
    """Within the block, the given (layer, head) attention heads write nothing: their slice
    of o_proj's input is zeroed (head None: every head of the layer). A causal check of what
    a head does (remove it, measure again); attention layers only."""
    cfg = model.config
    hooks = []
    try:
        for l, h in heads:
            if not 0 <= l < cfg.num_hidden_layers or cfg.layer_types[l] != FULL_ATTENTION:
                raise ValueError(f"layer {l} has no softmax attention to ablate")
            if h is not None and not 0 <= h < cfg.num_attention_heads:
                raise ValueError(f"head {h} out of range (layer {l} has "
                                 f"{cfg.num_attention_heads})")
            cols = slice(None) if h is None else slice(h * cfg.head_dim, (h + 1) * cfg.head_dim)

            def zero(module, args, cols=cols):
                x = args[0].clone()
                x[..., cols] = 0
                return (x, *args[1:])
            hooks.append(model.layer(l).self_attn.o_proj.register_forward_pre_hook(zero))
        yield model
    finally:
        for hook in hooks:
            hook.remove()
