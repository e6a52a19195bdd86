"""Proto codecs, in one place: torch tensors, sampling parameters and the request tokens a
pool's final call carries for them, what a pool call's reply holds, a `GenerateRequest` and
its events' prompt log-probs, and the prefill options a request carries to a prefill
replica.

Tensors go as dtype name, shape and raw C-contiguous bytes. The pool is stateless, so each
final call also carries what the penalties read: a request's distinct tokens and its
generated ones.
"""
from __future__ import annotations

import json

import numpy as np
import torch

from kernels.sampling import History, SamplingParams, TokenLogprob
from models.gdn import GDNInputs
from services.common.messages import (GenerationParams, PrefillRequest, RequestError, StageOutput,
                                      StructuredSpec)
from services.common.pb import splitstack_pb2 as pb


# ---- tensors -------------------------------------------------------------------------------
_NUMPY = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "int32": np.int32,
          "bool": np.bool_, "float16": np.float16}


def to_proto(t: torch.Tensor) -> pb.Tensor:
    t = t.detach().cpu().contiguous()
    name = str(t.dtype).removeprefix("torch.")
    data = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
    return pb.Tensor(dtype=name, shape=list(t.shape), data=data)


def from_proto(msg: pb.Tensor) -> torch.Tensor:
    if msg.dtype == "bfloat16":
        arr = np.frombuffer(msg.data, dtype=np.int16).reshape(tuple(msg.shape))
        return torch.from_numpy(arr.copy()).view(torch.bfloat16)
    if msg.dtype not in _NUMPY:
        raise ValueError(f"unsupported tensor dtype {msg.dtype!r}")
    arr = np.frombuffer(msg.data, dtype=_NUMPY[msg.dtype]).reshape(tuple(msg.shape))
    return torch.from_numpy(arr.copy())


# ---- sampling ------------------------------------------------------------------------------
def processing_fields(p: SamplingParams) -> dict:
    return {"presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty,
            "bias_tokens": [t for t, _ in p.logit_bias],
            "bias_values": [b for _, b in p.logit_bias]}


def processing_from(msg) -> dict:
    """Keyword arguments of `SamplingParams` (an unset repetition penalty is 1: none)."""
    return {"presence_penalty": msg.presence_penalty,
            "frequency_penalty": msg.frequency_penalty,
            "repetition_penalty": msg.repetition_penalty or 1.0,
            "logit_bias": tuple(zip(msg.bias_tokens, msg.bias_values))}


def history_fields(p: SamplingParams, history: History | None) -> dict:
    """What `p`'s processing reads of `history`, as the pool's message fields."""
    if history is None:
        return {}
    fields = {"banned_ids": list(history.banned)}
    if history.allowed is not None:      # a grammar's mask: its int32 words' bytes
        fields["allowed_mask"] = history.allowed.to(torch.int32).numpy().tobytes()
    if p.penalized:
        fields["output_ids"] = list(history.output)
        if p.repetition_penalty != 1.0:
            fields["seen_ids"] = sorted({*history.prompt, *history.output})
    return fields


def history_from(msg) -> History:
    """What a pool row's processing reads; the distinct tokens stand for the prompt, which
    is all the repetition penalty needs of it."""
    allowed = (torch.frombuffer(bytearray(msg.allowed_mask), dtype=torch.int32)
               if msg.allowed_mask else None)
    return History(list(msg.seen_ids), list(msg.output_ids), list(msg.banned_ids), allowed)


# ---- pool replies (MLP pool -> cache side) ------------------------------------------------
def generator_state(g: torch.Generator | None) -> bytes:
    """A request's sampler as a final call carries it (none: empty)."""
    return g.get_state().numpy().tobytes() if g is not None else b""


def generator_from(state: bytes) -> torch.Generator | None:
    if not state:
        return None
    gen = torch.Generator()
    gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return gen


def stage_parts(out: StageOutput) -> tuple[str, tuple]:
    """A stage's output as its reply's kind and tensors (`reply_value` reads them back)."""
    if out.gdn is None:
        return "attn", (out.z, out.k, out.v)
    return "gdn", (out.z, *out.gdn)


def reply_value(kind: str, tensors: list, generator_states=(), generators=()):
    """What a pool call returns, from its reply: a stage's `StageOutput`, a score's or a
    final's tensors. A final also leaves each request's own generator where the pool's
    draw left it (`generator_states`)."""
    if kind == "attn":
        return StageOutput(tensors[0], tensors[1], tensors[2])
    if kind == "gdn":
        return StageOutput(tensors[0], gdn=GDNInputs(*tensors[1:]))
    for g, state in zip(generators, generator_states):
        if g is not None:
            g.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return tuple(tensors)


# ---- generate requests (gateway -> attention service) ------------------------------------
def params_from_proto(req: pb.GenerateRequest) -> GenerationParams:
    sampling = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                              seed=req.seed if req.has_seed else None,
                              **processing_from(req))
    prefill, replay_ratio = options_from_proto(req.prefill)
    structured = None
    if req.HasField("structured"):
        m = req.structured
        structured = StructuredSpec(m.kind, m.value, m.field or "response_format",
                                    m.after if m.has_after else None)
    return GenerationParams(max_tokens=req.max_tokens, sampling=sampling,
                            structured=structured,
                            stop_token_ids=tuple(req.stop_token_ids),
                            ignore_eos=req.ignore_eos, prefill=prefill,
                            replay_ratio=replay_ratio,
                            logprobs=req.logprobs if req.has_logprobs else None,
                            min_tokens=req.min_tokens,
                            prompt_logprobs=(req.prompt_logprobs if req.has_prompt_logprobs
                                             else None))


INT64 = 2**63


def params_to_proto(prompt_ids: list[int], params: GenerationParams) -> pb.GenerateRequest:
    """Raises `RequestError` for what the message cannot carry: a token id or seed past
    int64."""
    s = params.sampling
    bad = next((t for t in prompt_ids if not -INT64 <= t < INT64), None)
    if bad is not None:
        raise RequestError("prompt", bad, "is not a token id of this model")
    if s.seed is not None and not -INT64 <= s.seed < INT64:
        raise RequestError("seed", s.seed, "must be in [-2**63, 2**63) on the Ray deployment")
    return pb.GenerateRequest(prompt_ids=prompt_ids, max_tokens=params.max_tokens,
                              temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                              has_seed=s.seed is not None, seed=s.seed or 0,
                              stop_token_ids=list(params.stop_token_ids),
                              ignore_eos=params.ignore_eos,
                              **processing_fields(s), min_tokens=params.min_tokens,
                              has_prompt_logprobs=params.prompt_logprobs is not None,
                              prompt_logprobs=params.prompt_logprobs or 0,
                              has_logprobs=params.logprobs is not None,
                              logprobs=params.logprobs or 0,
                              prefill=options_to_proto(params.prefill, params.replay_ratio),
                              structured=structured_to_proto(params.structured))


def structured_to_proto(spec: StructuredSpec | None) -> pb.StructuredOutput | None:
    if spec is None:
        return None
    return pb.StructuredOutput(kind=spec.kind, value=spec.value, field=spec.field,
                               has_after=spec.after is not None, after=spec.after or "")


def prompt_logprob_fields(entries: list[TokenLogprob] | None) -> dict:
    """A first token's prompt log-probs as `GenerateEvent` fields (`prompt_logprobs_from`
    reads them back)."""
    if entries is None:
        return {}
    return {"has_prompt_logprobs": True, "prompt_tokens": [e.token for e in entries],
            "prompt_logprobs": [e.logprob for e in entries],
            "prompt_k": len(entries[0].top) if entries else 0,
            "prompt_top_tokens": [t for e in entries for t, _ in e.top],
            "prompt_top_logprobs": [lp for e in entries for _, lp in e.top]}


def prompt_logprobs_from(ev: pb.GenerateEvent) -> list[TokenLogprob] | None:
    if not ev.has_prompt_logprobs:
        return None
    k, tops = ev.prompt_k, list(zip(ev.prompt_top_tokens, ev.prompt_top_logprobs))
    return [TokenLogprob(t, lp, tops[i * k:(i + 1) * k])
            for i, (t, lp) in enumerate(zip(ev.prompt_tokens, ev.prompt_logprobs))]


# ---- prefill options (attention service -> prefill replica) ------------------------------
def options_to_proto(prefill: PrefillRequest | None,
                     replay_ratio: float | None) -> pb.PrefillOptions:
    opts = pb.PrefillOptions()
    if prefill is not None:
        opts.mode = prefill.mode or ""
        if prefill.overrides is not None:
            opts.ridgefill_json = json.dumps(prefill.overrides)
    if replay_ratio is not None:
        opts.has_replay_ratio, opts.replay_ratio = True, replay_ratio
    return opts


def options_from_proto(opts: pb.PrefillOptions) -> tuple[PrefillRequest | None, float | None]:
    """-> (the request's prefill fields, its replay ratio), still unresolved. Raises
    `RequestError` for a `ridgefill` object that is not JSON."""
    overrides = None
    if opts.ridgefill_json:
        try:
            overrides = json.loads(opts.ridgefill_json)
        except json.JSONDecodeError as err:
            raise RequestError("ridgefill", opts.ridgefill_json,
                               f"ridgefill is not valid JSON: {err}") from err
    prefill = (PrefillRequest(opts.mode or None, overrides)
               if opts.mode or overrides is not None else None)
    return prefill, opts.replay_ratio if opts.has_replay_ratio else None
