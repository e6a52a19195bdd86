"""POST /v1/responses (OpenAI's Responses API) and GET /v1/responses/{id}.

A response request becomes a chat request (`to_chat`): `instructions` a system message,
`input` (a string, or message, `function_call` and `function_call_output` items) the
history, function `tools` and `tool_choice` as chat's, `text.format` as `response_format`.
It then runs as chat does (`chat.prepare`), and its answer is written as the Responses
API's output items: with `--reasoning-parser`, a `reasoning` item holding the thinking as
`reasoning_text`; a `message` with `output_text`; and a `function_call` per call. The wire
shapes are the `openai` package's own types. `reasoning` items in `input` (a client that
sends its earlier output back) are dropped, as a chat template drops earlier thinking.

With `previous_response_id`, the stored conversation of that response (its input and
output, not its instructions) comes before `input`. Responses are stored unless
`store: false`, for `--responses-ttl` seconds, in Redis with `--responses-redis-url`, else
in this process (`ResponseStore`).

Streaming sends the typed events: `response.created`, `response.in_progress`, per item
`response.output_item.added` ... `response.output_item.done` (a reasoning item's
`response.content_part.added`, `response.reasoning_text.delta`s and `.done`; a message's
`response.content_part.added`, `response.output_text.delta`s and `.done`; a call's
`response.function_call_arguments.delta`s and `.done`), then `response.completed`.
"""
from __future__ import annotations

import collections
import json
import time
import uuid
from typing import Literal

from fastapi import Request
from fastapi.responses import Response as HTTPResponse
from fastapi.responses import StreamingResponse
from openai.types import responses as wire
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.gateway.chat import Prepared, prepare
from services.gateway.gateway import Gateway
from services.gateway.limits import check_request
from services.gateway.protocol import APIError, ChatCompletionRequest, validation_error
from services.gateway.ratelimit import charge_tokens
from services.gateway.serving import Fanout
from services.gateway.tools import ToolCall, fragments


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: str
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None


# ---- request -> chat ------------------------------------------------------------------------
def history(items: str | list[dict]) -> list[dict]:
    """`input` as chat messages: consecutive function calls become one assistant message's
    `tool_calls`, each output a `tool` message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role, content = item.get("role"), item.get("content")
            if isinstance(content, list):
                parts = [p.get("text") for p in content if isinstance(p, dict)]
                if any(not isinstance(t, str) for t in parts) or len(parts) != len(content):
                    raise APIError(400, f"input[{i}]: only text content parts are served",
                                   "input")
                content = "".join(parts)
            if role not in ("user", "assistant", "system", "developer") \
                    or not isinstance(content, str):
                raise APIError(400, f"input[{i}]: a message needs a role (user, assistant, "
                                    "system, developer) and text content", "input")
            out.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(v, str) for v in (call["id"], *call["function"].values())):
                raise APIError(400, f"input[{i}]: a function_call needs call_id, name and "
                                    "arguments (strings)", "input")
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") \
                    and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise APIError(400, f"input[{i}]: a function_call_output needs call_id and "
                                    "output (strings)", "input")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue                        # earlier thinking: not part of the prompt
        else:
            raise APIError(400, f"input[{i}]: items of type {str(kind)[:40]!r} are not "
                                "served (message, function_call, function_call_output, "
                                "reasoning are)",
                           "input")
    return out


def to_chat(req: ResponsesRequest, earlier: list[dict]) -> ChatCompletionRequest:
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    messages += earlier + history(req.input)
    body: dict = {"model": req.model, "messages": messages, "top_p": req.top_p,
                  "parallel_tool_calls": req.parallel_tool_calls}
    for name in ("temperature", "seed"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            exclude={"type"}, exclude_none=True)} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = (choice if isinstance(choice, str) else
                               {"type": "function", "function": {"name": choice.name}})
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


# ---- the store ------------------------------------------------------------------------------
class ResponseStore:
    """Stored responses by id, for `previous_response_id` and GET: in Redis (`url`) or in
    this process (the most recent `capacity`), each for `ttl_s` seconds."""

    def __init__(self, url: str | None = None, ttl_s: int = 3600, capacity: int = 10_000):
        self.ttl_s, self.capacity = ttl_s, capacity
        self.redis = None
        if url:
            import redis.asyncio

            self.redis = redis.asyncio.Redis.from_url(url)
        self.local: collections.OrderedDict[str, tuple[float, str]] = collections.OrderedDict()

    async def put(self, response_id: str, record: dict) -> None:
        text = json.dumps(record)
        if self.redis is not None:
            await self.redis.set(f"splitstack:response:{response_id}", text, ex=self.ttl_s)
            return
        self.local[response_id] = (time.monotonic() + self.ttl_s, text)
        while len(self.local) > self.capacity:
            self.local.popitem(last=False)

    async def get(self, response_id: str) -> dict | None:
        if self.redis is not None:
            text = await self.redis.get(f"splitstack:response:{response_id}")
            return json.loads(text) if text is not None else None
        entry = self.local.get(response_id)
        if entry is None or entry[0] < time.monotonic():
            self.local.pop(response_id, None)
            return None
        return json.loads(entry[1])


# ---- the answer as output items -------------------------------------------------------------
def _message(item_id: str, text: str, status: str = "completed") -> wire.ResponseOutputMessage:
    return wire.ResponseOutputMessage(id=item_id, type="message", role="assistant",
                                      status=status, content=[wire.ResponseOutputText(
                                          type="output_text", text=text, annotations=[])])


def _reasoning(item_id: str, text: str, status: str = "completed") -> wire.ResponseReasoningItem:
    return wire.ResponseReasoningItem(id=item_id, type="reasoning", summary=[], status=status,
                                      content=[{"type": "reasoning_text", "text": text}])


def _call(item_id: str, call: ToolCall) -> wire.ResponseFunctionToolCall:
    return wire.ResponseFunctionToolCall(id=item_id, type="function_call", call_id=call.id,
                                         name=call.name, arguments=call.arguments,
                                         status="completed")


def _response(rid: str, req: ResponsesRequest, output: list, status: str, reason: str | None,
              prompt_tokens: int, tokens: int, created: int, model: str,
              reasoning_tokens: int = 0) -> wire.Response:
    incomplete = ({"reason": "max_output_tokens"} if status == "incomplete" else None)
    return wire.Response.model_validate({
        "id": rid, "object": "response", "created_at": created, "model": model,
        "status": status, "output": [o.model_dump() for o in output], "error": None,
        "incomplete_details": incomplete, "instructions": req.instructions,
        "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": req.temperature, "top_p": req.top_p,
        "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str) else
                        req.tool_choice.model_dump() if req.tool_choice else "auto"),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                            if req.text and req.text.format else {"type": "text"})},
        "usage": {"input_tokens": prompt_tokens, "output_tokens": tokens,
                  "total_tokens": prompt_tokens + tokens,
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": reasoning_tokens}},
    })


def _status(reason: str | None) -> str:
    return "incomplete" if reason == "length" else "completed"


def _record(chat: ChatCompletionRequest, text: str, calls: list[ToolCall],
            response: wire.Response) -> dict:
    """What a later `previous_response_id` continues from: the conversation without the
    system instructions, then this answer as an assistant message."""
    messages = [m.rendered() for m in chat.messages if m.role != "system"]
    answer = {"role": "assistant", "content": text or None}
    if calls:
        answer["tool_calls"] = [c.wire() for c in calls]
    return {"messages": messages + [answer], "response": response.model_dump(mode="json")}


# ---- the endpoints ----------------------------------------------------------------------------
async def create_response(gateway: Gateway, store: ResponseStore, req: ResponsesRequest,
                          request: Request):
    arrival = time.perf_counter()
    earlier: list[dict] = []
    if req.previous_response_id is not None:
        found = await store.get(req.previous_response_id)
        if found is None:
            raise APIError(404, f"no stored response {req.previous_response_id!r} (expired, "
                                "or stored with store: false)", "previous_response_id")
        earlier = found["messages"]
    chat = to_chat(req, earlier)
    check_request(request, chat)
    ready = await prepare(gateway, chat)
    await charge_tokens(request, len(ready.ids) + ready.params.max_tokens)
    fan = Fanout(gateway, chat, [(ready.ids, ready.params)], arrival)
    rid, created = "resp_" + uuid.uuid4().hex, int(time.time())
    if req.stream:
        firsts = await fan.start()
        return StreamingResponse(_events(gateway, store, req, chat, ready, fan, firsts, rid,
                                         created), media_type="text/event-stream")
    results = await fan.collect(request)
    if results is None:
        return HTTPResponse(status_code=499)
    (r,) = results
    thought, text, calls = ready.split(r.text)
    output = [_reasoning("rs_" + uuid.uuid4().hex, thought)] if thought else []
    output += ([_message("msg_" + uuid.uuid4().hex, text or "", _status(r.reason))]
               if text or not calls else [])
    output += [_call("fc_" + uuid.uuid4().hex, c) for c in calls]
    response = _response(rid, req, output, _status(r.reason), r.reason, fan.prompt_tokens,
                         r.n, created, gateway.model_name, count_tokens(gateway, thought))
    if req.store:
        await store.put(rid, _record(chat, text, calls, response))
    return response.model_dump(mode="json", exclude_none=False)


def count_tokens(gateway: Gateway, text: str | None) -> int:
    """Tokens of the reasoning text, as the tokenizer counts it (`reasoning_tokens`)."""
    return len(gateway.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0


async def retrieve_response(store: ResponseStore, response_id: str) -> dict:
    found = await store.get(response_id)
    if found is None:
        raise APIError(404, f"no stored response {response_id!r}", "response_id")
    return found["response"]


async def _events(gateway: Gateway, store: ResponseStore, req: ResponsesRequest,
                  chat: ChatCompletionRequest, ready: Prepared, fan: Fanout, firsts, rid: str,
                  created: int):
    seq = iter(range(1 << 62))
    answer = ready.stream()
    output: list = []                   # finished items
    text_item: dict | None = None       # the open message item: id, index, text
    thought_item: dict | None = None    # the open reasoning item: id, index, text
    content, calls, n, reason, thinking = "", [], 0, None, ""

    def event(model) -> str:
        return f"event: {model.type}\ndata: {model.model_dump_json(exclude_none=True)}\n\n"

    def shell(status: str) -> wire.Response:
        return _response(rid, req, list(output), status, reason, fan.prompt_tokens, n,
                         created, gateway.model_name, count_tokens(gateway, thinking))

    def opened(prefix: str, make, part: dict) -> tuple[dict, list[str]]:
        """A new item (`make(id, text, status)`) at the next index, and the events that
        open it and its one content part."""
        item = {"id": prefix + uuid.uuid4().hex, "index": len(output), "text": ""}
        return item, [
            event(wire.ResponseOutputItemAddedEvent(
                type="response.output_item.added", output_index=item["index"],
                item=make(item["id"], "", "in_progress"), sequence_number=next(seq))),
            event(wire.ResponseContentPartAddedEvent(
                type="response.content_part.added", item_id=item["id"],
                output_index=item["index"], content_index=0, part=part,
                sequence_number=next(seq)))]

    def closed(item: dict | None, make, status: str) -> list[str]:
        """The events that close an open item (none for None); the item joins `output`."""
        if item is None:
            return []
        item_id, index, text = item["id"], item["index"], item["text"]
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        if make is _reasoning:
            done = wire.ResponseReasoningTextDoneEvent(
                type="response.reasoning_text.done", text=text, sequence_number=next(seq),
                **where)
            part = {"type": "reasoning_text", "text": text}
        else:
            done = wire.ResponseTextDoneEvent(
                type="response.output_text.done", text=text, sequence_number=next(seq),
                logprobs=[], **where)
            part = {"type": "output_text", "text": text, "annotations": []}
        finished = make(item_id, text, status)
        output.append(finished)
        return [event(done), event(wire.ResponseContentPartDoneEvent(
                    type="response.content_part.done", part=part, sequence_number=next(seq),
                    **where)),
                event(wire.ResponseOutputItemDoneEvent(
                    type="response.output_item.done", output_index=index, item=finished,
                    sequence_number=next(seq)))]

    try:
        yield event(wire.ResponseCreatedEvent(type="response.created", response=shell(
            "in_progress"), sequence_number=next(seq)))
        yield event(wire.ResponseInProgressEvent(type="response.in_progress", response=shell(
            "in_progress"), sequence_number=next(seq)))
        async for _, delta in fan.merged(firsts):
            n, reason = delta.n, delta.reason
            thought, text, _ = answer.feed(delta.text, delta.reason is not None)
            if thought:
                thinking += thought
                for piece in closed(text_item, _message, "completed"):   # thinking comes first
                    yield piece
                text_item = None
                if thought_item is None:
                    thought_item, events = opened("rs_", _reasoning,
                                                  {"type": "reasoning_text", "text": ""})
                    for piece in events:
                        yield piece
                thought_item["text"] += thought
                yield event(wire.ResponseReasoningTextDeltaEvent(
                    type="response.reasoning_text.delta", item_id=thought_item["id"],
                    output_index=thought_item["index"], content_index=0, delta=thought,
                    sequence_number=next(seq)))
            if text or answer.called:                                  # the answer began
                for piece in closed(thought_item, _reasoning, "completed"):
                    yield piece
                thought_item = None
            if text:
                content += text
                if text_item is None:
                    text_item, events = opened("msg_", _message, {
                        "type": "output_text", "text": "", "annotations": []})
                    for piece in events:
                        yield piece
                text_item["text"] += text
                yield event(wire.ResponseTextDeltaEvent(
                    type="response.output_text.delta", item_id=text_item["id"],
                    output_index=text_item["index"], content_index=0, delta=text,
                    sequence_number=next(seq), logprobs=[]))
            new_calls = answer.tools.calls[len(calls):] if answer.tools else []
            if new_calls:
                for piece in closed(text_item, _message, "completed"):
                    yield piece
                text_item = None
                for call in new_calls:
                    calls.append(call)
                    for piece in _call_events(call, len(output), seq, event):
                        yield piece
                    output.append(_call("fc_" + call.id.removeprefix("call_"), call))
        for piece in (closed(thought_item, _reasoning, _status(reason))
                      + closed(text_item, _message, _status(reason))):
            yield piece
        if all(o.type == "reasoning" for o in output):    # no text and no call
            output.append(_message("msg_" + uuid.uuid4().hex, "", _status(reason)))
        final = shell(_status(reason))
        if req.store:
            await store.put(rid, _record(chat, content, calls, final))
        yield event(wire.ResponseCompletedEvent(type="response.completed", response=final,
                                                sequence_number=next(seq)))
    except APIError as exc:                 # failed mid-stream
        yield f"event: error\ndata: {json.dumps(exc.body())}\n\n"
    finally:
        await fan.close()


def _call_events(call: ToolCall, index: int, seq, event):
    item_id = "fc_" + call.id.removeprefix("call_")
    pending = wire.ResponseFunctionToolCall(id=item_id, type="function_call", call_id=call.id,
                                            name=call.name, arguments="", status="in_progress")
    yield event(wire.ResponseOutputItemAddedEvent(type="response.output_item.added",
                                                  output_index=index, item=pending,
                                                  sequence_number=next(seq)))
    for piece in fragments(call.arguments):
        yield event(wire.ResponseFunctionCallArgumentsDeltaEvent(
            type="response.function_call_arguments.delta", item_id=item_id,
            output_index=index, delta=piece, sequence_number=next(seq)))
    yield event(wire.ResponseFunctionCallArgumentsDoneEvent(
        type="response.function_call_arguments.done", item_id=item_id, output_index=index,
        arguments=call.arguments, sequence_number=next(seq)))
    yield event(wire.ResponseOutputItemDoneEvent(
        type="response.output_item.done", output_index=index, item=_call(item_id, call),
        sequence_number=next(seq)))
