"""POST /v1/chat/completions: the chat template's prompt with `n` choices, and the chat
`logprobs` object (`content`, with each token's bytes); whole or streamed."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from services.gateway.gateway import Delta, Gateway
from services.gateway.limits import check_request, off_loop
from services.gateway.logprobs import chat_logprobs
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.ratelimit import charge_tokens
from services.gateway.serving import Fanout, head, sse_response, usage


async def create_chat_completion(gateway: Gateway, req: ChatCompletionRequest,
                                 request: Request):
    arrival = time.perf_counter()
    check_request(request, req)
    ids = await off_loop(gateway.chat_ids, req)
    params = gateway.params(req, len(ids), req.max_completion_tokens or req.max_tokens)
    await charge_tokens(request, req.candidates() * (len(ids) + params.max_tokens))
    top = head(gateway, "chatcmpl-", "chat.completion.chunk" if req.stream else
               "chat.completion")
    fan = Fanout(gateway, req, [(ids, params)], arrival)
    report = params.logprobs is not None

    def logprobs(delta: Delta) -> dict | None:
        return chat_logprobs(gateway.words, delta.logprobs) if report else None

    if req.stream:
        firsts = await fan.start()

        def choice(i: int, delta: Delta) -> dict:
            return {"index": i, "delta": {"content": delta.text} if delta.text else {},
                    "finish_reason": delta.reason, "logprobs": logprobs(delta)}

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        roles = [{"index": i, "delta": {"role": "assistant"}, "finish_reason": None}
                 for i in range(len(fan.streams))]
        return sse_response(fan, firsts, top, include_usage, choice, lead=roles)
    results = await fan.collect(request)
    if results is None:
        return Response(status_code=499)
    choices = [{"index": i, "message": {"role": "assistant", "content": r.text},
                "finish_reason": r.reason, "logprobs": logprobs(r)}
               for i, r in enumerate(results)]
    return {**top, "choices": choices, "usage": usage(fan.prompt_tokens,
                                                      sum(r.n for r in results))}
