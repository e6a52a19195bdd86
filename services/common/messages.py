"""The types that cross a boundary: what a request asks for (`GenerationParams`), what a
step gives back (`StepOutput`), a prompt prefilled for decode elsewhere (`PromptExport`), a
request's prefill fields as the client gave them (`PrefillRequest`), what a pool
stage call returns (`StageOutput`), and the refusal every layer raises (`RequestError`).
Every service may import this module; it imports nothing of ours beyond `kernels` and
`models`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.sampling import MAX_LOGPROBS, History, SamplingParams, top_logprobs
from models.gdn import GDNInputs

PREFILL_MODES = ("exact", "ridgefill")


class RequestError(ValueError):
    """A request the engine refuses; carries the offending field and value."""

    def __init__(self, field_name: str, value, message: str):
        super().__init__(f"{field_name}: {message} (got {value!r})")
        self.field, self.value, self.message = field_name, value, message

    def __reduce__(self):                  # pickled whole (the engine process's refusals)
        return type(self), (self.field, self.value, self.message)


class Unavailable(RuntimeError):
    """No engine can take a request now (every attention service is down): a 503."""


class EngineDeadError(RuntimeError):
    """The engine stopped stepping (vLLM's `EngineDeadError`): every request it held has
    failed, and it takes no more. Its process exits so the orchestrator restarts it."""


def check_prompt_ids(prompt_ids: list[int], vocab_size: int, field_name: str = "prompt") -> None:
    """A prompt every engine can run: at least one token, each an id of the vocabulary
    (an id outside it would index past the embedding table)."""
    if not prompt_ids:
        raise RequestError(field_name, prompt_ids, "must contain at least one token")
    bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int)
           or not 0 <= t < vocab_size]
    if bad:
        raise RequestError(field_name, bad[:4],
                           f"token ids must be integers in [0, {vocab_size})")


def check_request(prompt_ids: list[int], params: GenerationParams, vocab_size: int) -> None:
    """What depends on the model's vocabulary: the ids of the prompt, the logit bias and
    the stop tokens."""
    check_prompt_ids(prompt_ids, vocab_size)
    bad = [t for t, _ in params.sampling.logit_bias if t >= vocab_size]
    if bad:
        raise RequestError("logit_bias", bad[:4], f"token ids must be in [0, {vocab_size})")
    bad = [t for t in params.stop_token_ids if isinstance(t, bool) or not isinstance(t, int)
           or not 0 <= t < vocab_size]
    if bad:
        raise RequestError("stop_token_ids", bad[:4],
                           f"token ids must be integers in [0, {vocab_size})")


@dataclass(frozen=True)
class StructuredSpec:
    """What a request's output must match (structured outputs): `kind` is json_schema
    (`value`: the schema as JSON text), json_object (any JSON object), regex or grammar
    (EBNF); `field`: the request field it came from, named when it cannot be compiled;
    `after`: a reasoning model's end-of-thinking text, before which the output is free."""
    kind: str
    value: str = ""
    field: str = "response_format"
    after: str | None = None      # the grammar starts after this text (reasoning's end)


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 16
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_logits: bool = False     # keep each sampled position's logits (tests, evals)
    prefill: PrefillRequest | None = None  # the request's prefill fields, unresolved: the
                                           # engine that owns the prompt's prefill resolves them
    replay_ratio: float | None = None  # Tail-Replay r on a prefix-cache hit (None: the engine's)
    export_prompt: bool = False     # hand the prompt's KV, GDN states and logits back (the
                                    # prefill service's engine: decode continues elsewhere)
    logprobs: int | None = None     # each token's k most likely alternatives with their
                                    # log-probs (OpenAI `logprobs`); None: not asked
    min_tokens: int = 0             # no end-of-sequence or stop token before this many
    prompt_logprobs: int | None = None  # each prompt token's log-prob and k alternatives
                                        # (OpenAI's `echo` with `logprobs`); exact prefill
    structured: StructuredSpec | None = None   # the grammar the output must match

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise RequestError("max_tokens", self.max_tokens, "must be a positive integer")
        r = self.replay_ratio
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float))
                              or not 0.0 <= r <= 1.0):
            raise RequestError("replay_ratio", r, "must be a number in [0, 1]")
        if (isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int)
                or not 0 <= self.min_tokens <= self.max_tokens):
            raise RequestError("min_tokens", self.min_tokens,
                               f"must be an integer in [0, max_tokens={self.max_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int)
                                  or not 0 <= k <= MAX_LOGPROBS):
                raise RequestError(name, k, f"must be an integer in [0, {MAX_LOGPROBS}]")

    def history(self, prompt: list[int], output: list[int], eos: tuple[int, ...],
                allowed=None) -> History:
        """What sampling reads of a request at this step: its tokens, before `min_tokens`
        the tokens that would end it (stop ids, and EOS unless ignored), and `allowed`,
        its grammar's packed bitmask of the tokens it may sample now."""
        banned = ()
        if len(output) < self.min_tokens:
            banned = self.stop_token_ids + (() if self.ignore_eos else tuple(eos))
        return History(prompt, output, banned, allowed)

    def stops(self, output: list[int], tok: int, eos: tuple[int, ...]) -> bool:
        """`tok`, just appended to `output`, ends the request."""
        return len(output) > self.min_tokens and (
            tok in self.stop_token_ids or (not self.ignore_eos and tok in eos))

    def top_logprobs(self, logits: torch.Tensor) -> list[tuple[int, float]] | None:
        """The alternatives a step reports for this request (None when not asked)."""
        return None if self.logprobs is None else top_logprobs(logits, self.logprobs)


@dataclass
class StepOutput:
    seq_id: int
    token: int | None            # None when the request ended without a new token
    logprob: float | None
    finished: bool
    finish_reason: str | None
    error: str | None = None
    export: PromptExport | None = None   # `params.export_prompt`: with the first token
    top_logprobs: list[tuple[int, float]] | None = None   # `params.logprobs`: (token, log-prob)
    prompt_logprobs: list | None = None   # `params.prompt_logprobs`: with the first token,
                                          # a TokenLogprob per prompt token after the first
    # with a request's first token in this engine, its engine-side stage times (seconds):
    queue_s: float | None = None          # add_request to its first scheduling
    prefill_s: float | None = None        # first scheduling to the first token


@dataclass
class PromptExport:
    """A prefilled prompt, for decode elsewhere: what the attention service stores."""
    kv: torch.Tensor                      # [F, 2, N, KV, D] every full-attention layer's K/V
    conv: torch.Tensor | None             # [Lg, conv_dim, Kc − 1] GDN states after row N − 1
    recurrent: torch.Tensor | None        # [Lg, HV, Dk, Dv] fp32
    logits: torch.Tensor | None = None    # [V] of row N − 1 (the first token's distribution)

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[2]


@dataclass(frozen=True)
class PrefillRequest:
    """A request's prefill fields as the client gave them (`prefill_mode`, the `ridgefill`
    object). They travel unchecked to the engine that owns the prompt's prefill (the
    embedded engine, or a prefill replica) and are resolved there, once, against its
    prefill service's defaults (`PrefillService.resolve`)."""
    mode: str | None = None
    overrides: object = None          # the `ridgefill` object, checked when resolved

    def __post_init__(self):
        if self.mode is not None and self.mode not in PREFILL_MODES:
            raise RequestError("prefill_mode", self.mode,
                               f"must be one of {PREFILL_MODES}")

    @property
    def asks_for_fill(self) -> bool:
        """Whether they need a RidgeFill prefill service (exact prefill needs none)."""
        return self.mode not in (None, "exact") or bool(self.overrides)


@dataclass
class StageOutput:
    z: torch.Tensor                      # [N, h] input of layer l
    k: torch.Tensor | None = None        # [N, KV, D] (full-attention layer)
    v: torch.Tensor | None = None
    gdn: GDNInputs | None = None         # (linear-attention layer)
