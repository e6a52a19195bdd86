"""`SamplingParams`' logit processing (penalties, logit bias) to and from the proto messages
that carry it: the pool's `SamplingParams` and the attention service's `GenerateRequest`,
which name the fields alike. The pool is stateless, so each final call also carries what
the penalties read: a request's distinct tokens and its generated ones."""
from __future__ import annotations

from kernels.sampling import History, SamplingParams


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
    if p.penalized:
        fields["output_ids"] = list(history.output)
        if p.repetition_penalty != 1.0:
            fields["seen_ids"] = sorted({*history.prompt, *history.output})
    return fields


def history_from(msg) -> History:
    """What a pool row's processing reads; the distinct tokens stand for the prompt, which
    is all the repetition penalty needs of it."""
    return History(list(msg.seen_ids), list(msg.output_ids), list(msg.banned_ids))
