"""Metrics that do not hide fill error (seed 000, "average loss hides the error").

- key-token mask: tail tokens whose exact loss rises by more than `threshold` nat when the
  context is truncated to the tail alone (tokens the prefix actually contributes to);
- new-token mask: tokens not inside an `span`-token window that already occurred earlier;
- decoding agreement: top-1 agreement and KL(exact ‖ arm);
- percentile bootstrap intervals (resampling items within each task) and paired differences.
"""
from __future__ import annotations

import numpy as np
import torch


def token_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logits [T, V] predicting ids[1:] -> per-token loss [T−1] (nat) for tokens 1..T−1."""
    return torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:], reduction="none")


def key_token_mask(loss_full: torch.Tensor, loss_truncated: torch.Tensor,
                   threshold: float = 2.0) -> torch.Tensor:
    """Both [n] over the same scored tokens -> bool [n]: truncation raises loss > threshold."""
    return (loss_truncated - loss_full) > threshold


def new_token_mask(ids: list[int], span: int = 8) -> np.ndarray:
    """bool [T]: False for every token inside a `span`-gram that occurred earlier in `ids`."""
    seen: set[tuple[int, ...]] = set()
    copied = np.zeros(len(ids), dtype=bool)
    for j in range(len(ids) - span + 1):
        gram = tuple(ids[j:j + span])
        if gram in seen:
            copied[j:j + span] = True
        seen.add(gram)
    return ~copied


def agreement(exact_logits: torch.Tensor, arm_logits: torch.Tensor) -> dict:
    """[n, V] each -> top-1 agreement and per-token KL(exact ‖ arm) (median and mean)."""
    p_log = torch.log_softmax(exact_logits.float(), -1)
    q_log = torch.log_softmax(arm_logits.float(), -1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    top1 = (exact_logits.argmax(-1) == arm_logits.argmax(-1)).float()
    return {"top1": top1.mean().item(), "kl_median": kl.median().item(),
            "kl_mean": kl.mean().item(), "kl": kl}


def bootstrap_ci(values_by_task: dict[str, list[float]], resamples: int = 5000,
                 seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """Mean over all items and its percentile interval, resampling items within each task."""
    rng = np.random.default_rng(seed)
    groups = [np.asarray(v, dtype=float) for v in values_by_task.values() if len(v)]
    if not groups:
        return float("nan"), float("nan"), float("nan")
    total = sum(len(g) for g in groups)
    point = sum(g.sum() for g in groups) / total
    means = np.zeros(resamples)
    for g in groups:
        idx = rng.integers(0, len(g), size=(resamples, len(g)))
        means += g[idx].sum(axis=1)
    means /= total
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(point), float(lo), float(hi)


def paired_difference(a_by_task: dict[str, list[float]], b_by_task: dict[str, list[float]],
                      resamples: int = 5000, seed: int = 0):
    """Mean of (a − b) over paired items with its within-task bootstrap interval."""
    diffs = {t: [x - y for x, y in zip(a_by_task[t], b_by_task[t])] for t in a_by_task}
    return bootstrap_ci(diffs, resamples, seed)
