"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

`sample` takes one row of logits per sequence and one `SamplingParams` per row. Rows with
temperature 0 are greedy. `top_logprobs` gives a row's most likely tokens with their
log-probs (the OpenAI `logprobs` fields). A seeded request owns a `torch.Generator` (created by the caller and
reused across steps) so its stream of tokens is reproducible regardless of batching.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


MAX_LOGPROBS = 20      # most alternatives a request may ask for per token (vLLM's default)


class SamplingError(ValueError):
    """Invalid sampling parameters; carries the offending field and value."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0            # 0 = disabled
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise SamplingError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] (already temperature-scaled) -> logits with excluded tokens at -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the mass strictly before it already reaches top_p
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop),
                                    float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None] | None = None):
    """logits [B, V] -> (tokens [B] long, logprobs [B] fp32 of the chosen tokens).

    Logprobs are those of the model distribution (before temperature / filtering), as the
    OpenAI API reports them.
    """
    logits = logits.float()
    logprobs_all = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = filter_logits(logits[i] / p.temperature, p.top_k, p.top_p)
        gen = generators[i] if generators else None
        probs = row.softmax(-1)
        if gen is not None and gen.device != probs.device:   # a request's CPU generator
            probs = probs.cpu()                                # draws the same on any device
        tokens[i] = torch.multinomial(probs, 1, generator=gen)[0].to(tokens.device)
    return tokens, logprobs_all.gather(-1, tokens[:, None])[:, 0]


def top_logprobs(logits: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """logits [V] -> the k most likely (token, log-prob), most likely first, of the model
    distribution (before temperature / filtering, as `sample` reports the chosen token's)."""
    if k <= 0:
        return []
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]))
    return list(zip(ids.tolist(), values.tolist()))
