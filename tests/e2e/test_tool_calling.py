"""Tool calling over real HTTP with the official `openai` client, on the embedded and the Ray
deployment (an attention service and an MLP pool replica over gRPC, the grammar's masks
travelling to the pool): a forced call whose arguments match the function's schema, the
same call streamed, a whole loop (call, tool answer, final answer) streamed and not, and
400s for tools the request does not offer."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from services.deployment.server import build_embedded
from tests.helpers.gateway import MODEL, ZOO, client, ray_deployment, running

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 30}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time",
                                           "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = {"tools": TOOLS, "max_tokens": 60, "temperature": 0, "parallel_tool_calls": False}


@pytest.fixture(scope="module", params=["embedded", "ray"])
def base(request):
    if request.param == "embedded":
        with running(build_embedded(ZOO, kv_cache_bytes=64 << 20, threads=1)) as url:
            yield url
        return
    request.getfixturevalue("ray_session")
    with ray_deployment() as url:
        yield url


def streamed(c, **kw) -> tuple[str, list[dict], str]:
    """(content, calls by index, finish reason) of a streamed chat answer."""
    content, calls, reason = "", {}, None
    for ch in c.chat.completions.create(model=MODEL, stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] = (tc.function.name if tc.function else None) or entry["name"]
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
        reason = ch.choices[0].finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_a_forced_call_matches_its_functions_schema(base, choice):
    r = client(base).chat.completions.create(model=MODEL, messages=ASK, tool_choice=choice,
                                             **FORCED)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_streamed_arguments_equal_the_whole_ones(base):
    c = client(base)
    whole = c.chat.completions.create(model=MODEL, messages=ASK, tool_choice="required",
                                      **FORCED).choices[0].message.tool_calls
    content, calls, reason = streamed(c, messages=ASK, tool_choice="required", **FORCED)
    assert reason == "tool_calls" and content == ""
    assert [(x["name"], x["arguments"]) for x in calls] == \
        [(w.function.name, w.function.arguments) for w in whole]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_loop_completes(base, stream):
    c = client(base)
    first = c.chat.completions.create(model=MODEL, messages=ASK, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}, **FORCED).choices[0].message
    call = first.tool_calls[0]
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id,
                      "content": json.dumps({"temp_c": 18, "sky": "clear"})}]
    kw = {"messages": history, "tools": TOOLS, "tool_choice": "none", "max_tokens": 24,
          "temperature": 0}
    if stream:
        content, calls, reason = streamed(c, **kw)
    else:
        m = c.chat.completions.create(model=MODEL, **kw).choices[0]
        content, calls, reason = m.message.content, m.message.tool_calls or [], m.finish_reason
    assert reason in ("stop", "length") and calls == [] and content


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tools_are_400s_naming_the_field(base, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client(base).chat.completions.create(model=MODEL, messages=ASK, max_tokens=5,
                                             **extra)
    assert err.value.body["param"] == param
