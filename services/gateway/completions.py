"""POST /v1/completions: a batch of prompts with `n` choices each (the `n` most likely of
`best_of`), `echo`, and the legacy `logprobs` object; whole or streamed.

Choices are indexed prompt·n + choice, as OpenAI's batched completions are.
"""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from services.gateway.gateway import Delta, Gateway
from services.gateway.limits import check_request, off_loop
from services.gateway.logprobs import TokenLogprob, completion_logprobs
from services.gateway.protocol import CompletionRequest
from services.gateway.ratelimit import charge_tokens
from services.gateway.serving import Fanout, Jobs, head, sse_response, usage


async def create_completion(gateway: Gateway, req: CompletionRequest, request: Request):
    arrival = time.perf_counter()
    check_request(request, req)
    jobs = [(ids, gateway.params(req, len(ids), req.max_tokens))
            for ids in await off_loop(gateway.completion_ids, req)]
    await charge_tokens(request, req.candidates() * sum(len(ids) + p.max_tokens
                                                        for ids, p in jobs))
    top = head(gateway, "cmpl-", "text_completion")
    fan = Fanout(gateway, req, jobs, arrival)
    echo = _Echo(gateway, req, jobs)
    report = jobs[0][1].logprobs is not None     # asked for (best_of keeps them anyway)
    if req.stream:
        return await _stream(gateway, req, fan, top, echo, report)
    results = await fan.collect(request)
    if results is None:
        return Response(status_code=499)
    kept = []                  # (prompt, result), n per prompt in order
    for j in range(len(jobs)):
        cands = results[j * fan.per:(j + 1) * fan.per]
        if fan.per > req.n:    # best_of: the n with the highest log-probability
            cands = sorted(cands, key=lambda r: -sum(e.logprob for e in r.logprobs))[:req.n]
        kept += [(j, r) for r in cands]
    choices = []
    for i, (j, r) in enumerate(kept):
        text, entries = echo(j, r)
        choices.append({"index": i, "text": text, "finish_reason": r.reason,
                        "logprobs": completion_logprobs(gateway.words, entries)[0]
                        if report else None})
    return {**top, "choices": choices,
            "usage": usage(fan.prompt_tokens, sum(r.n for r in results))}


async def _stream(gateway: Gateway, req: CompletionRequest, fan: Fanout, top: dict,
                  echo: _Echo, report: bool):
    firsts = await fan.start()
    offsets = [0] * len(fan.streams)   # where each choice's next text starts
    started = [False] * len(fan.streams)

    def choice(i: int, delta: Delta) -> dict:
        text, entries = (echo(fan.owner[i], delta) if not started[i]
                         else (delta.text, delta.logprobs))
        started[i] = True
        logprobs = None
        if report:
            logprobs, offsets[i] = completion_logprobs(gateway.words, entries, offsets[i])
        return {"index": i, "text": text, "finish_reason": delta.reason, "logprobs": logprobs}

    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return sse_response(fan, firsts, top, include_usage, choice)


class _Echo:
    """A choice's first text and log-probs: with `echo`, its prompt's come first (the very
    first prompt token with a null log-prob, as OpenAI reports it)."""

    def __init__(self, gateway: Gateway, req: CompletionRequest, jobs: Jobs):
        self.on = req.echo
        self.gateway, self.jobs = gateway, jobs
        self.texts = req.prompts() if self.on else []

    def __call__(self, j: int, d: Delta) -> tuple[str, list[TokenLogprob]]:
        if not self.on:
            return d.text, d.logprobs
        ids = self.jobs[j][0]
        given = self.texts[j]
        prefix = given if isinstance(given, str) else self.gateway.tokenizer.decode(ids)
        first = [TokenLogprob(ids[0], None, [])] if d.prompt is not None else []
        return prefix + d.text, first + (d.prompt or []) + d.logprobs
