"""POST /v1/chat/completions: the chat template's prompt with `n` choices, and the chat
`logprobs` object (`content`, with each token's bytes); whole or streamed. With `tools`, the
answer's calls become `tool_calls` (`services.gateway.tools`): parsed from what the model
wrote under `auto`, forced by a grammar under `required` or a named function."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import Response

from services.common.messages import GenerationParams
from services.gateway.gateway import Delta, Gateway
from services.gateway.limits import check_request, off_loop
from services.gateway.logprobs import chat_logprobs
from services.gateway.protocol import APIError, ChatCompletionRequest
from services.gateway.ratelimit import charge_tokens
from services.gateway.serving import Fanout, head, sse_response, usage
from services.gateway.reasoning import END as END_OF_THINKING
from services.gateway.reasoning import ReasoningFormat, ReasoningStream
from services.gateway.tools import ToolCall, ToolFormat, ToolStream


@dataclass
class Prepared:
    """A chat request made ready to generate: its prompt ids and engine parameters, and
    how its answer is read back (tool calls, reasoning)."""
    ids: list[int]
    params: GenerationParams
    mode: str | None                    # `ChatCompletionRequest.tool_mode`
    names: set[str]                     # the offered functions
    fmt: ToolFormat
    thinking: ReasoningFormat | None

    def split(self, text: str) -> tuple[str | None, str, list[ToolCall]]:
        """(reasoning, content, tool calls) of a whole answer."""
        thought, text = self.thinking.split(text) if self.thinking else (None, text)
        if self.mode:
            content, calls = self.fmt.parse(text, self.names)
            if calls:
                return thought, content, calls
        return thought, text, []


    def stream(self) -> AnswerStream:
        return AnswerStream(ToolStream(self.fmt, self.names) if self.mode else None,
                            ReasoningStream(self.thinking) if self.thinking else None)


@dataclass
class AnswerStream:
    """One streamed answer read back as it comes: `feed` each delta's text (`last` on the
    final one) -> (reasoning text, content text, tool-call chunks) to send now."""
    tools: ToolStream | None
    thinker: ReasoningStream | None

    def feed(self, text: str, last: bool) -> tuple[str, str, list[dict]]:
        thought, calls = "", []
        if self.thinker is not None:
            thought, text = self.thinker.feed(text)
            if last:
                more_thought, more = self.thinker.finish()
                thought, text = thought + more_thought, text + more
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if last:
                more, rest = self.tools.finish()
                text, calls = text + more, calls + rest
        return thought, text, calls

    @property
    def called(self) -> bool:
        return self.tools is not None and bool(self.tools.calls)


async def prepare(gateway: Gateway, req: ChatCompletionRequest) -> Prepared:
    """The template's prompt and the request's parameters: a forced tool call becomes a
    grammar, and with a reasoning parser any grammar starts after the thinking."""
    ids = await off_loop(gateway.chat_ids, req)
    params = gateway.params(req, len(ids), req.max_completion_tokens or req.max_tokens)
    mode = req.tool_mode()
    fmt = gateway.tool_format
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
    return Prepared(ids, params, mode, {t.function.name for t in req.tools or ()}, fmt,
                    thinking)


async def create_chat_completion(gateway: Gateway, req: ChatCompletionRequest,
                                 request: Request):
    arrival = time.perf_counter()
    check_request(request, req)
    ready = await prepare(gateway, req)
    ids, params = ready.ids, ready.params
    await charge_tokens(request, req.candidates() * (len(ids) + params.max_tokens))
    top = head(gateway, "chatcmpl-", "chat.completion.chunk" if req.stream else
               "chat.completion")
    fan = Fanout(gateway, req, [(ids, params)], arrival)
    report = params.logprobs is not None

    def logprobs(delta: Delta) -> dict | None:
        return chat_logprobs(gateway.words, delta.logprobs) if report else None

    if req.stream:
        firsts = await fan.start()
        answers = [ready.stream() for _ in fan.streams]

        def choice(i: int, delta: Delta) -> dict:
            thought, text, calls = answers[i].feed(delta.text, delta.reason is not None)
            reason = "tool_calls" if delta.reason and answers[i].called else delta.reason
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
        thought, text, calls = ready.split(r.text)
        message = {"role": "assistant", "content": text}
        reason = r.reason
        if calls:
            message = {"role": "assistant", "content": text or None,
                       "tool_calls": [c.wire() for c in calls]}
            reason = "tool_calls"
        if thought is not None:
            message["reasoning_content"] = thought
        choices.append({"index": i, "message": message, "finish_reason": reason,
                        "logprobs": logprobs(r)})
    return {**top, "choices": choices, "usage": usage(fan.prompt_tokens,
                                                      sum(r.n for r in results))}
