"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

`sample` takes one row of logits per sequence and one `SamplingParams` per row. Rows with
temperature 0 are greedy. Logit bias and the repetition / frequency / presence penalties
change the logits a token is chosen from (greedy ones too), in vLLM's order; the penalties
read the request's tokens, which the caller passes per row (`histories`). `top_logprobs` gives a row's most likely tokens with their
log-probs (the OpenAI `logprobs` fields). A seeded request owns a `torch.Generator` (created by the caller and
reused across steps) so its stream of tokens is reproducible regardless of batching.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch


MAX_LOGPROBS = 20      # most alternatives a request may ask for per token (vLLM's default)
MAX_LOGIT_BIAS = 100.0    # OpenAI's range for a logit bias value: [-100, 100]
MAX_PENALTY = 2.0         # OpenAI's range for presence / frequency penalties: [-2, 2]


class SamplingError(ValueError):
    """Invalid sampling parameters; carries the offending field and value."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0            # 0 = disabled
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0     # subtracted once from each token generated so far
    frequency_penalty: float = 0.0    # subtracted once per time a token was generated
    repetition_penalty: float = 1.0   # tokens of the prompt or the output: a positive logit
                                      # divided by it, a negative one multiplied (HF, vLLM)
    logit_bias: tuple[tuple[int, float], ...] = ()    # (token, added to its logit)

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise SamplingError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise SamplingError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                                    f"got {getattr(self, name)!r}")
        if not (0.0 < self.repetition_penalty < math.inf):
            raise SamplingError(f"repetition_penalty must be > 0, got "
                                f"{self.repetition_penalty!r}")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise SamplingError(f"logit_bias keys must be token ids, got {token!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise SamplingError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                                    f"{MAX_LOGIT_BIAS:g}], got {bias!r} for token {token}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Reads the request's tokens (`sample` needs its history)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


class History(NamedTuple):
    """What a row's logit processing reads of its request at this step."""
    prompt: Sequence[int]              # the repetition penalty's tokens, with `output`
    output: Sequence[int]              # the tokens generated so far
    banned: Sequence[int] = ()         # tokens it may not sample now (the end-of-sequence
                                       # and stop tokens before `min_tokens`)
    allowed: torch.Tensor | None = None   # packed int32 bitmask [ceil(V/32)] of the only
                                          # tokens it may sample (a grammar), bit t%32 of
                                          # word t//32; None: any


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed int32 bitmasks [..., W] -> bool [..., vocab_size] (xgrammar's layout)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.to(torch.int32)[..., None] >> shifts) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab_size].bool()


def apply_masks(logits: torch.Tensor, histories) -> tuple[torch.Tensor, list]:
    """The rows' grammar masks applied in one batched op (xgrammar's CPU or CUDA kernel when
    it is installed): (logits with every disallowed token at -inf, the histories without
    their masks). `logits` itself when none has one."""
    rows = [i for i, h in enumerate(histories or ()) if h is not None and h.allowed is not None]
    if not rows:
        return logits, histories
    vocab = logits.shape[-1]
    words = torch.full((logits.shape[0], -(-vocab // 32)), -1, dtype=torch.int32)
    for i in rows:                 # a row's tokens past its grammar's vocabulary: disallowed
        allowed = histories[i].allowed
        words[i, :allowed.numel()] = allowed
        words[i, allowed.numel():] = 0
    words = words.to(logits.device)
    out = logits.clone()
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        out[rows] = out[rows].masked_fill(~unpack_bitmask(words[rows], vocab), float("-inf"))
    else:
        apply_token_bitmask_inplace(out, words, vocab_size=vocab, indices=rows)
    histories = list(histories)
    for i in rows:
        histories[i] = histories[i]._replace(allowed=None)
    return out, histories


def process_logits(logits: torch.Tensor, p: SamplingParams,
                   history: History | None = None) -> torch.Tensor:
    """One row [V]: logit bias, then the repetition penalty over the prompt's and output's
    tokens, then the frequency and presence penalties over the output's (vLLM's order),
    with the banned tokens at -inf. Returns `logits` itself when nothing changes it. (A
    grammar's `history.allowed` is applied to the whole batch first: `apply_masks`.)"""
    banned = history.banned if history is not None else ()
    if not p.logit_bias and not p.penalized and not banned:
        return logits
    if p.penalized and history is None:
        raise ValueError("penalties need the request's tokens (history)")
    logits = logits.clone()
    if banned:
        logits[torch.tensor(list(banned), device=logits.device)] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
        logits.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias],
                                               dtype=logits.dtype, device=logits.device))
    if not p.penalized:
        return logits
    prompt, output = history.prompt, history.output
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt, *output}), dtype=torch.long, device=logits.device)
        if seen.numel():
            v = logits[seen]
            logits[seen] = torch.where(v > 0, v / p.repetition_penalty,
                                       v * p.repetition_penalty)
    if output and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(list(output), device=logits.device),
                                minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits


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
           generators: list[torch.Generator | None] | None = None,
           histories: list[History | None] | None = None):
    """logits [B, V] -> (tokens [B] long, logprobs [B] fp32 of the chosen tokens).

    `histories[i]`: row i's request tokens, needed when its params have penalties.
    Logprobs are those of the model distribution (before bias, penalties, temperature and
    filtering), as vLLM reports them by default.
    """
    logits = logits.float()
    logprobs_all = torch.log_softmax(logits, dim=-1)
    logits, histories = apply_masks(logits, histories)
    tokens = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        base = logits[i]
        row = process_logits(base, p, histories[i] if histories else None)
        if p.greedy:
            if row is not base:
                tokens[i] = row.argmax()
            continue
        row = filter_logits(row / p.temperature, p.top_k, p.top_p)
        gen = generators[i] if generators else None
        probs = row.softmax(-1)
        if gen is not None and gen.device != probs.device:   # a request's CPU generator
            probs = probs.cpu()                                # draws the same on any device
        tokens[i] = draw(probs, gen).to(tokens.device)
    return tokens, logprobs_all.gather(-1, tokens[:, None])[:, 0]


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token (a 0-d tensor on `probs`' device) from `probs` [V], drawn with
    `generator` (the global one when None).

    `torch.multinomial` draws one exponential per token and takes the token whose
    probability over its exponential is largest. Two sets of logits that differ in their
    last bits (the pool's products against the monolithic model's) draw different tokens
    only when the top two ratios tie within that difference. Inverting the cumulative sum
    at one uniform number instead is cheaper, but it flips whenever the number falls near
    any of the V interval edges, each shifted by the differences before it: 22 seeds in
    3,000 over a 49K vocabulary with logits 1e-5 apart, against none here."""
    return torch.multinomial(probs, 1, generator=generator)[0]


def skip(generator: torch.Generator, vocab_size: int, n: int = 1) -> None:
    """Advance `generator` past `n` draws (`draw`) over `vocab_size` tokens, whatever they
    drew: a draw's use of the generator does not depend on the probabilities."""
    uniform = torch.full((vocab_size,), 1.0 / vocab_size)
    for _ in range(n):
        torch.multinomial(uniform, 1, generator=generator)


class TokenLogprob(NamedTuple):
    """One token's entry of a request's log-probs."""
    token: int
    logprob: float | None              # None: the prompt's first token (nothing precedes it)
    top: list[tuple[int, float]]       # (token, log-prob) alternatives, most likely first


def score_rows(head, x: torch.Tensor, targets: torch.Tensor, k: int,
               rows_per_call: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prompt's log-probs: rows x [R, h] through `head` (to logits [rows, V]) a bounded
    number at a time, with the token that followed each row, targets [R] -> (each target's
    log-prob [R], the rows' k most likely tokens [R, k] and their log-probs [R, k])."""
    chosen, ids, values = [], [], []
    for a in range(0, x.shape[0], rows_per_call):
        logprobs = torch.log_softmax(head(x[a:a + rows_per_call]).float(), dim=-1)
        chosen.append(logprobs.gather(-1, targets[a:a + rows_per_call, None])[:, 0])
        top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        values.append(top.values)
        ids.append(top.indices)
    if not chosen:
        return (torch.empty(0), torch.empty(0, k, dtype=torch.long), torch.empty(0, k))
    return torch.cat(chosen), torch.cat(ids), torch.cat(values)


def as_entries(targets: torch.Tensor, logprobs: torch.Tensor, ids: torch.Tensor,
               values: torch.Tensor) -> list[TokenLogprob]:
    """`score_rows`' tensors as one TokenLogprob per row."""
    return [TokenLogprob(t, lp, list(zip(i, v))) for t, lp, i, v in zip(
        targets.tolist(), logprobs.tolist(), ids.tolist(), values.tolist())]


def top_logprobs(logits: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """logits [V] -> the k most likely (token, log-prob), most likely first, of the model
    distribution (before temperature / filtering, as `sample` reports the chosen token's)."""
    if k <= 0:
        return []
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]))
    return list(zip(ids.tolist(), values.tolist()))
