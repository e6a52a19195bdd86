"""Each eval metric on hand-built cases, and the task builder on a toy tokenizer."""
from __future__ import annotations

import random

import numpy as np
import torch

from evals.metrics import (agreement, bootstrap_ci, key_token_mask, new_token_mask,
                           paired_difference, token_losses)
from evals.tasks import Item, make_item


def test_key_token_mask_threshold_is_strict():
    full = torch.tensor([1.0, 0.5, 3.0, 0.1])
    trunc = torch.tensor([3.5, 2.5, 3.1, 2.1])       # rises: 2.5, 2.0, 0.1, 2.0
    assert key_token_mask(full, trunc).tolist() == [True, False, False, False]


def test_token_losses_shift_by_one():
    logits = torch.full((3, 5), -1e4)
    logits[0, 2] = logits[1, 4] = 0.0                 # predicts ids[1] = 2, ids[2] = 4
    assert torch.allclose(token_losses(logits, torch.tensor([9, 2, 4])), torch.zeros(2))


def test_new_token_mask_excludes_repeated_spans():
    span = list(range(100, 108))
    ids = [1, 2] + span + [3, 4, 5] + span + [6]
    mask = new_token_mask(ids, span=8)
    assert mask[:13].all()                            # first occurrence stays "new"
    assert not mask[13:21].any() and mask[21]         # the repeat is excluded, then new again
    assert new_token_mask([7] * 7, span=8).all()      # shorter than a span: nothing repeats


def test_new_token_mask_partial_overlap():
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 0]
    mask = new_token_mask(ids, span=8)
    assert mask.tolist() == [True] * 9 + [False] * 8 + [True]


def test_agreement_identical_and_different():
    a = torch.randn(6, 10)
    same = agreement(a, a.clone())
    assert same["top1"] == 1.0 and abs(same["kl_mean"]) < 1e-6
    b = a.clone()
    b[0] = -a[0]                                      # flips row 0's argmax
    diff = agreement(a, b)
    assert abs(diff["top1"] - 5 / 6) < 1e-6 and diff["kl_mean"] > 0 and diff["kl_median"] < 1e-6


def test_bootstrap_interval_covers_true_mean_at_nominal_rate():
    """Bernoulli(0.3) samples of 40: the 95% interval should cover 0.3 ~95% of the time."""
    rng = np.random.default_rng(1)
    covered = 0
    trials = 300
    for t in range(trials):
        vals = {"task": (rng.random(40) < 0.3).astype(float).tolist()}
        _, lo, hi = bootstrap_ci(vals, resamples=1000, seed=t)
        covered += lo <= 0.3 <= hi
    assert 0.88 <= covered / trials <= 0.99


def test_bootstrap_resamples_within_task():
    """A task of constant values adds no variance: the interval only reflects the other."""
    _, lo, hi = bootstrap_ci({"a": [1.0] * 20, "b": [0.0] * 20})
    assert lo == hi == 0.5


def test_paired_difference_sees_consistent_small_gap():
    base = list(np.linspace(0, 5, 30))
    mean, lo, hi = paired_difference({"t": [x + 0.1 for x in base]}, {"t": base})
    assert abs(mean - 0.1) < 1e-9 and lo > 0.09 and hi < 0.11


class ToyTokenizer:
    """One token per whitespace-separated word (stable ids)."""

    chat_template = None

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]}


def test_item_places_needle_at_depth_and_records_region():
    tok = ToyTokenizer()
    filler = tok(" ".join(f"w{i}" for i in range(5000)))["input_ids"]
    item = make_item("single", tok, filler, 400, 0.1, random.Random(0), 0)
    assert len(item.prompt_ids) == 400
    pos = item.needle_positions[0]
    inv = {v: k for k, v in tok.vocab.items()}
    assert inv[item.prompt_ids[pos]] == "The" and item.answers[0] + "." in [
        inv[t] for t in item.prompt_ids[pos:pos + 12]]
    assert item.in_filled_region(tail_len=100)
    late = make_item("single", tok, filler, 400, 0.97, random.Random(0), 0)
    assert not late.in_filled_region(tail_len=100)


def test_once_and_code_items_state_a_serial_code_once():
    """`once` states the value in one sentence of the other wordings; `code` values are
    dash-joined groups of letters and digits. Neither is in the default task set."""
    from evals.tasks import ALL_TASKS, ONCE_TEMPLATES, TASKS

    tok = ToyTokenizer()
    filler = tok(" ".join(f"w{i}" for i in range(5000)))["input_ids"]
    item = make_item("code", tok, filler, 400, 0.5, random.Random(4), 1, once=True)
    inv = {v: k for k, v in tok.vocab.items()}
    words = [inv[t] for t in item.prompt_ids]
    value = item.answers[0]
    groups = value.split("-")
    assert 2 <= len(groups) <= 5 and all(3 <= len(g) <= 8 and g.isalnum() for g in groups)
    assert sum(value in w for w in words) == 1      # stated once, not twice
    needle = " ".join(words[item.needle_positions[0]:item.needle_positions[0] + 9])
    key = words[item.needle_positions[0] + 2]
    assert needle == ONCE_TEMPLATES[1][0].format(kind="code", k=key, v=value)
    assert " ".join(words[-8:]) == ONCE_TEMPLATES[1][2].format(kind="code", k=key)
    twice = make_item("code", tok, filler, 400, 0.5, random.Random(4), 1)
    inv = {v: k for k, v in tok.vocab.items()}
    assert sum(twice.answers[0] in inv[t] for t in twice.prompt_ids) == 2
    assert "code" in ALL_TASKS and "code" not in TASKS


def test_multivalue_item_scores_partial_answers():
    item = Item("multivalue", 10, 0.5, [0] * 10, ["111", "222", "333"], [1, 2, 3])
    assert item.score("values are 111 and 333") == 2 / 3


def test_fill_arms_pair_with_identity_under_the_same_selector():
    """`ridgefill+probe` is paired with `exact`, with `identity` and with `identity+probe`
    (same exact rows, different fill); the tables name the reference of each pair."""
    from evals.run import MATCHED, ArmResult, EvalConfig, markdown_table, summarize

    rng = random.Random(0)
    base = [rng.random() for _ in range(40)]
    results = {}
    for name, shift in (("exact", 0.0), ("identity", 0.5), ("ridgefill+probe", 0.1),
                        ("identity+probe", 0.3), ("ridgefill", 0.2)):
        res = ArmResult()
        for v in base:
            res.add("new_token_loss", "docs", v + shift)
        results[name] = res
    cfg = EvalConfig(lengths=(1024,), tasks=("single",), resamples=500)
    summary = summarize(results, cfg, "m", {})
    matched = summary[MATCHED]
    assert set(matched) == {"ridgefill+probe"}           # plain ridgefill has no twin
    pair = matched["ridgefill+probe"]
    assert pair["against"] == "identity+probe"
    assert abs(pair["new_token_loss"]["mean"] - (-0.2)) < 1e-9
    assert summary["paired_vs_identity"]["ridgefill+probe"]["against"] == "identity"
    assert abs(summary["paired_vs_identity"]["ridgefill+probe"]["new_token_loss"]["mean"]
               - (-0.4)) < 1e-9
    table = markdown_table(summary)
    assert "### `ridgefill+probe` − `identity+probe` (paired)" in table
    assert "### `ridgefill` − `exact` (paired)" in table


def test_zero_docs_means_no_loss_documents():
    from evals import run

    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(5000))}
    assert run.doc_token_windows(Tok(), 0, 1024) == []
    assert len(run.doc_token_windows(Tok(), 2, 1024)) == 2
