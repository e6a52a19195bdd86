"""Speculative decoding without a draft model: n-gram prompt lookup (vLLM's `ngram`).

Before a step, each running request looks for the last `n` tokens it holds (n from
`prompt_lookup_max` down to `prompt_lookup_min`) earlier in its prompt and output. At the
latest earlier match, the tokens that followed are its draft: up to
`num_speculative_tokens` of them (`DraftPlanner` then keeps those expected to pay for their
rows). The step then feeds the request's last token and the draft as one chunk of 1 + k
rows (`ScheduledChunk.draft`), each row attending over the cache up to itself as a decode
row does (in one paged kernel call with the step's decode rows, in either runner), and
samples every row. Row i's history is the output plus the first i
draft tokens, so penalties and `min_tokens` see what a step-by-step decode would have seen.

Verification: the step emits row 0's token, then row i + 1's for as long as row i's token
equals draft token i. For a greedy request, row i's token is the one a plain decode would
pick after the draft's first i tokens, so the output is unchanged. For a sampled request
this is rejection sampling with a draft of probability 1 on its token: draft token d is
kept with probability p(d) (the row drew d), and when it is not, the row's own draw is a
token from p without d, renormalized (the residual distribution), so every emitted token
has the plain decode's distribution. Row i of a seeded request draws with the sampler
state a plain decode would have at that token (`draft_generators`), and the request's
sampler ends where a plain decode of the emitted tokens leaves it: a seeded request gives
the plain decode's tokens, draft or not. The keys and values of the rejected draft tokens
stay in the cache past the sequence's end, where the next step overwrites them; blocks
taken for them and no longer needed go back at once.

Which requests draft: those without a grammar, and none while more requests than
`disable_by_batch_size` run (a large batch's products cost more per extra row, and a draft
the model rejects is paid for by every row). On the Gated DeltaNet hybrids a draft step
runs the recurrence a row at a time and keeps each row's states, and the sequence's slot
then takes those after its last kept row (`runner.DraftStates`). Both deployments draft:
on the Ray deployment the attention services run the draft rows through the pool's stages
like a prompt chunk's, and the pool samples every row."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.sampling import skip
from services.engine.sequence import Sequence


@dataclass(frozen=True)
class NgramConfig:
    num_speculative_tokens: int = 4     # k: draft tokens per step at most
    prompt_lookup_max: int = 4          # the longest suffix looked up
    prompt_lookup_min: int = 2          # the shortest
    disable_by_batch_size: int | None = None   # no drafts while more requests than this run
    adaptive: bool = True     # verify only the draft tokens expected to pay (`DraftPlanner`)

    def __post_init__(self):
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got "
                             f"{self.disable_by_batch_size}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @classmethod
    def from_dict(cls, spec: dict) -> NgramConfig:
        """vLLM's `--speculative-config` form: {"method": "ngram",
        "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m,
        "disable_by_batch_size": b}, and "adaptive": false to verify every draft whole."""
        spec = dict(spec)
        method = spec.pop("method", "ngram")
        if method != "ngram":
            raise ValueError(f"speculative method {method!r} is not supported (only "
                             f"'ngram': prompt lookup, no draft model)")
        known = {"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "disable_by_batch_size", "adaptive"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"unknown speculative-config keys {unknown}; known: "
                             f"{sorted(known | {'method'})}")
        if not isinstance(spec.get("adaptive", True), bool):
            raise ValueError("speculative-config adaptive must be true or false")
        bad = [k for k, v in spec.items() if k != "adaptive" and (
            isinstance(v, bool) or not isinstance(v, int)
            and not (k == "disable_by_batch_size" and v is None))]
        if bad:
            raise ValueError(f"speculative-config {bad} must be integers")
        return cls(**spec)


def propose(tokens: list[int], config: NgramConfig, limit: int) -> list[int]:
    """The draft after `tokens`: at most `limit` (and k) tokens that followed the latest
    earlier occurrence of its longest matching suffix; [] when none matches."""
    limit = min(limit, config.num_speculative_tokens)
    if limit <= 0 or len(tokens) <= config.prompt_lookup_min:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(config.prompt_lookup_max, len(tokens) - 1),
                   config.prompt_lookup_min - 1, -1):
        suffix = arr[-n:]
        # windows that start at 0 .. len - n - 1 (the suffix itself excluded)
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + limit].tolist()
    return []


def drafts(seq: Sequence) -> bool:
    """Whether `seq` may draft: any request without a grammar (a grammar's matcher would
    have to walk the draft before its rows' masks exist)."""
    return seq.matcher is None


def draft_generators(generator: torch.Generator | None, k: int, vocab_size: int) -> list:
    """The samplers of a draft step's 1 + k rows: row i draws with the state a plain decode
    would have after i more tokens (`generator` itself for row 0, a copy advanced i draws
    for the others: `kernels.sampling.skip`, about 0.9 ms a draw over a 49K vocabulary on
    a CPU core). None for an unseeded request: its rows draw from the global generator."""
    if generator is None:
        return [None] * (1 + k)
    rows = [generator]
    for _ in range(k):
        nxt = torch.Generator(generator.device)
        nxt.set_state(rows[-1].get_state())
        skip(nxt, vocab_size)
        rows.append(nxt)
    return rows


class DraftPlanner:
    """How many of its draft tokens each request verifies in a step: those expected to pay
    for themselves (the step's rows grow by one per draft token, and a draft the model
    rejects is paid for by every row).

    It learns two things as it runs, with nothing fitted to a workload:
    - the step's cost in rows: the mean time of steps of only decode and draft rows, by
      their number of rows, and the straight line through them (a: fixed, b: per row);
    - each request's acceptance rate: the fraction of its draft tokens kept, a moving
      average, starting from the engine's over every draft so far.
    Draft token i of a request is kept with probability rate^i, so each candidate token is
    worth rate^i tokens for b seconds. Taken best first, a token stays in the step while
    its worth per second beats the step's tokens per second so far. Until steps of two
    sizes have been timed, every draft is verified (that is how they get timed), and a
    request's first draft verifies at least one token (so that it gets a rate of its own;
    a request whose drafts did not pay drafts no more)."""

    SMOOTHING = 0.25          # weight of the newest sample in a request's moving average

    def __init__(self):
        self.step_s: dict[int, float] = {}     # rows -> mean seconds
        self.kept, self.tries = 1.0, 2.0        # every draft's, from an even prior

    @property
    def rate(self) -> float:
        return self.kept / self.tries

    def observe_step(self, rows: int, seconds: float) -> None:
        """A step of `rows` decode and draft rows (no prompt chunk) took `seconds`."""
        old = self.step_s.get(rows)
        self.step_s[rows] = seconds if old is None else old + self.SMOOTHING * (seconds - old)

    def observe_draft(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A draft of `proposed` tokens whose first `accepted` were kept: the per-token
        rate that explains it (kept tokens over tries, the first rejected one a try)."""
        tries = accepted + (accepted < proposed)
        r = accepted / tries
        seq.draft_rate = self.rate if seq.draft_rate is None else seq.draft_rate
        seq.draft_rate += self.SMOOTHING * (r - seq.draft_rate)
        self.kept += accepted
        self.tries += tries

    def cost(self) -> tuple[float, float] | None:
        """(a, b): a step of n rows takes about a + b·n seconds; None before two sizes."""
        if len(self.step_s) < 2:
            return None
        n = np.array(list(self.step_s), dtype=np.float64)
        t = np.array(list(self.step_s.values()))
        b = float(((n - n.mean()) * (t - t.mean())).sum() / ((n - n.mean()) ** 2).sum())
        return max(float(t.mean() - b * n.mean()), 0.0), max(b, 1e-9)

    def trim(self, seqs: list[Sequence], rows: int) -> None:
        """Cut each of `seqs`' drafts to the tokens that pay, in a step of `rows` other
        rows (its decode rows)."""
        cost = self.cost()
        if cost is None:
            return
        a, b = cost
        worth = sorted(((self.rate if s.draft_rate is None else s.draft_rate) ** (i + 1), k, i)
                       for k, s in enumerate(seqs) for i in range(len(s.draft)))
        keep = [0] * len(seqs)
        tokens, seconds = float(rows), a + b * rows
        for value, k, i in reversed(worth):       # the most likely to be kept first
            if value * seconds <= b * tokens:
                break
            tokens, seconds = tokens + value, seconds + b
            keep[k] = max(keep[k], i + 1)
        for s, n in zip(seqs, keep):
            del s.draft[max(n, s.draft_rate is None):]


@dataclass
class SpecStats:
    """Counts since start (vLLM's spec-decode counters): steps that verified a draft,
    draft tokens proposed, of them accepted."""
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
