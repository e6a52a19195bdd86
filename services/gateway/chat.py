"""POST /v1/chat/completions: the chat template's prompt with `n` choices, and the chat
`logprobs` object (`content`, with each token's bytes); whole or streamed. With `tools`, the
answer's calls become `tool_calls` (`services.gateway.tools`): parsed from what the model
wrote under `auto`, forced by a grammar under `required` or a named function."""
from __future__ import annotations

import time
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response

from services.gateway.gateway import Delta, Gateway
from services.gateway.limits import check_request, off_loop
from services.gateway.logprobs import chat_logprobs
from services.gateway.protocol import APIError, ChatCompletionRequest
from services.gateway.ratelimit import charge_tokens
from services.gateway.serving import Fanout, head, sse_response, usage
from services.gateway.reasoning import END as END_OF_THINKING
from services.gateway.reasoning import ReasoningStream
from services.gateway.tools import ToolStream


async def create_chat_completion(gateway: Gateway, req: ChatCompletionRequest,
                                 request: Request):
    arrival = time.perf_counter()
    check_request(request, req)
    ids = await off_loop(gateway.chat_ids, req)
    params = gateway.params(req, len(ids), req.max_completion_tokens or req.max_tokens)
    mode = req.tool_mode()
    fmt = gateway.tool_format
    names = {t.function.name for t in req.tools or ()}
    if mode not in (None, "auto"):            # required, or one named function: a grammar
        if params.structured is not None:
            raise APIError(400, "tool_choice that forces a call cannot be combined with "
                                "response_format or structured_outputs", "tool_choice")
        functions = [t.function.model_dump() for t in req.tools
                     if mode == "required" or t.function.name == mode]
        params = replace(params, structured=fmt.grammar(functions, req.parallel_tool_calls))
    thinking = gateway.reasoning
    if thinking is not None and params.structured is not None and \
            req.template_kwargs().get("enable_thinking", True):
        # the grammar starts once the model has finished thinking
        params = replace(params, structured=replace(params.structured, after=END_OF_THINKING))
    await charge_tokens(request, req.candidates() * (len(ids) + params.max_tokens))
    top = head(gateway, "chatcmpl-", "chat.completion.chunk" if req.stream else
               "chat.completion")
    fan = Fanout(gateway, req, [(ids, params)], arrival)
    report = params.logprobs is not None

    def logprobs(delta: Delta) -> dict | None:
        return chat_logprobs(gateway.words, delta.logprobs) if report else None

    if req.stream:
        firsts = await fan.start()
        parsers = [ToolStream(fmt, names) if mode else None for _ in fan.streams]
        thinkers = [ReasoningStream(thinking) if thinking else None for _ in fan.streams]

        def choice(i: int, delta: Delta) -> dict:
            text, calls, reason, thought = delta.text, [], delta.reason, ""
            if thinkers[i] is not None:
                thought, text = thinkers[i].feed(text)
                if reason:
                    more_thought, more = thinkers[i].finish()
                    thought, text = thought + more_thought, text + more
            if parsers[i] is not None:
                text, calls = parsers[i].feed(text)
                if reason:
                    more, last = parsers[i].finish()
                    text, calls = text + more, calls + last
                    reason = "tool_calls" if parsers[i].calls else reason
            body = {"content": text} if text else {}
            if thought:
                body["reasoning_content"] = thought
            if calls:
                body["tool_calls"] = calls
            return {"index": i, "delta": body, "finish_reason": reason,
                    "logprobs": logprobs(delta)}

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        roles = [{"index": i, "delta": {"role": "assistant"}, "finish_reason": None}
                 for i in range(len(fan.streams))]
        return sse_response(fan, firsts, top, include_usage, choice, lead=roles)
    results = await fan.collect(request)
    if results is None:
        return Response(status_code=499)
    choices = []
    for i, r in enumerate(results):
        thought, text = thinking.split(r.text) if thinking else (None, r.text)
        message = {"role": "assistant", "content": text}
        reason = r.reason
        if mode:
            content, calls = fmt.parse(text, names)
            if calls:
                message = {"role": "assistant", "content": content or None,
                           "tool_calls": [c.wire() for c in calls]}
                reason = "tool_calls"
        if thought is not None:
            message["reasoning_content"] = thought
        choices.append({"index": i, "message": message, "finish_reason": reason,
                        "logprobs": logprobs(r)})
    return {**top, "choices": choices, "usage": usage(fan.prompt_tokens,
                                                      sum(r.n for r in results))}
