"""Tool calling's pure parts: the formats' parsers, the streamed parser against the whole
one, the grammar a forced call compiles to, and the chat fields' checks."""
from __future__ import annotations

import json

import pytest

from services.gateway.protocol import APIError, ChatCompletionRequest
from services.gateway.tools import FORMATS, ToolStream, default_format

HERMES, LLAMA = FORMATS["hermes"], FORMATS["llama3_json"]
NAMES = {"get_weather", "add"}
TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def test_hermes_blocks_become_calls_and_the_rest_content():
    content, calls = HERMES.parse(TEXT, NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("text", [
    "no calls here",
    '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',   # not offered
    '<tool_call>\n{"name": "add", "arguments": \n</tool_call>',           # not JSON
    '<tool_call>\n{"name": "add", "arguments": {}}',                      # cut before its end
])
def test_what_is_not_a_complete_known_call_stays_text(text):
    assert HERMES.parse(text, NAMES) == (text, [])


def test_llama3_json_answers():
    content, calls = LLAMA.parse('{"name": "add", "parameters": {"a": 1}}; '
                                 '{"name": "get_weather", "parameters": {"city": "Oslo"}}', NAMES)
    assert content == "" and [c.name for c in calls] == ["add", "get_weather"]
    assert LLAMA.parse("Sure, 3.", NAMES) == ("Sure, 3.", [])


@pytest.mark.parametrize("fmt, text", [(HERMES, TEXT), (LLAMA, '{"name": "add", '
                                                                '"parameters": {"a": 1}}')])
@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_calls_equal_the_whole_ones_however_the_text_is_cut(fmt, text, piece):
    stream = ToolStream(fmt, NAMES)
    content, chunks = "", []
    for a in range(0, len(text), piece):
        c, k = stream.feed(text[a:a + piece])
        content, chunks = content + c, chunks + k
    c, k = stream.finish()
    content, chunks = content + c, chunks + k
    whole_content, whole = fmt.parse(text, NAMES)
    assert content.strip() == whole_content
    calls: dict[int, dict] = {}
    for ch in chunks:
        entry = calls.setdefault(ch["index"], {"name": None, "arguments": ""})
        entry["name"] = ch["function"].get("name") or entry["name"]
        entry["arguments"] += ch["function"]["arguments"]
        if "id" in ch:
            assert ch["type"] == "function" and ch["id"].startswith("call_")
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == \
        [(c.name, c.arguments) for c in whole]


def test_text_that_only_looks_like_a_tag_start_is_sent():
    stream = ToolStream(HERMES, NAMES)
    assert stream.feed("a <tool") == ("a ", [])          # may begin a call: held back
    assert stream.feed("kit> b") == ("<toolkit> b", [])
    assert stream.finish() == ("", [])


def test_a_forced_call_compiles_to_a_grammar_that_only_allows_calls():
    from services.common.tokenizer import eos_token_ids, load_tokenizer
    from services.engine.structured import Grammars
    from tests.helpers.gateway import ZOO

    tok = load_tokenizer(ZOO)
    grammars = Grammars(lambda: tok, 49152, eos_token_ids(ZOO))
    spec = HERMES.grammar([{"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}],
        parallel=False)
    assert spec.field == "tools"
    matcher = grammars.matcher(grammars.compile(spec))
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>'
    assert all(matcher.accept(t) for t in tok(good, add_special_tokens=False)["input_ids"])
    assert matcher.accept(eos_token_ids(ZOO)[0]) and matcher.done
    matcher = grammars.matcher(grammars.compile(spec))
    bad = tok('<tool_call>\n{"name": "sub"', add_special_tokens=False)["input_ids"]
    assert not all(matcher.accept(t) for t in bad)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "hi"}], **fields})


TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def test_tool_choice_modes():
    assert chat().tool_mode() is None
    assert chat(tools=[TOOL]).tool_mode() == "auto"
    assert chat(tools=[TOOL], tool_choice="none").tool_mode() is None
    assert chat(tools=[TOOL], tool_choice="required").tool_mode() == "required"
    assert chat(tools=[TOOL], tool_choice={"type": "function",
                                           "function": {"name": "add"}}).tool_mode() == "add"


@pytest.mark.parametrize("fields, param", [
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "sub"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL, TOOL]}, "tools"),
])
def test_bad_tool_fields_are_400s_naming_the_field(fields, param):
    with pytest.raises(APIError) as err:
        chat(**fields).tool_mode()
    assert err.value.status == 400 and err.value.param == param


def test_history_keeps_tool_calls_and_ids():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]})
    rendered = [m.rendered() for m in req.messages]
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'
    assert rendered[2]["tool_call_id"] == "call_1"
    with pytest.raises(ValueError, match="tool_call_id"):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [
            {"role": "tool", "content": "3"}]})
    with pytest.raises(APIError):
        chat(chat_template_kwargs={"tools": []}).template_kwargs()


def test_the_default_format_follows_the_template():
    assert default_format(None) == "hermes"
    assert default_format("{{ '<|python_tag|>' }}") == "llama3_json"


def test_a_call_streams_as_it_is_written():
    """The header as soon as the name is complete, then each new piece of the arguments,
    before the block has ended (vLLM's streaming parsers; holding a call to its end made a
    slow call look stuck)."""
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call>')
    stream = ToolStream(HERMES, NAMES)
    cut = text.index('"city"') + 3                    # inside the arguments
    content, chunks = "", []
    for ch in text[:cut]:
        c, k = stream.feed(ch)
        content, chunks = content + c, chunks + k
    assert content == ""
    assert chunks[0] == {"index": 0, "id": chunks[0]["id"], "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}
    so_far = "".join(k["function"]["arguments"] for k in chunks[1:])
    assert so_far == '{"ci' and len(chunks) == 1 + len(so_far)    # one piece per delta
    for ch in text[cut:]:
        c, k = stream.feed(ch)
        content, chunks = content + c, chunks + k
    c, k = stream.finish()
    args = "".join(k["function"]["arguments"] for k in chunks[1:])
    assert content + c == "" and k == []
    assert json.loads(args) == {"city": "Paris", "unit": "celsius"}
    assert args == HERMES.parse(text, NAMES)[1][0].arguments      # what the whole one says


def test_arguments_are_the_text_the_model_wrote():
    compact = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":[2, 3]}}\n</tool_call>'
    (call,) = HERMES.parse(compact, NAMES)[1]
    assert call.arguments == '{"a":1,"b":[2, 3]}'
    (bare,) = HERMES.parse('<tool_call>\n{"name": "add"}\n</tool_call>', NAMES)[1]
    assert bare.arguments == "{}"


def test_an_unoffered_function_streams_as_text_and_a_cut_call_ends_where_it_was_cut():
    stream = ToolStream(HERMES, NAMES)
    block = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    content = "".join(stream.feed(ch)[0] for ch in block)
    assert content == block and stream.calls == []
    stream = ToolStream(HERMES, NAMES)
    chunks = []
    for ch in '<tool_call>\n{"name": "add", "arguments": {"a": 1':
        chunks += stream.feed(ch)[1]
    assert chunks[0]["function"]["name"] == "add"
    assert stream.finish() == ("", [])            # no text repeats what was sent
    assert stream.calls == []                     # and no complete call was made


def test_llama3_json_calls_stream_one_after_another():
    text = '{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {}}'
    stream = ToolStream(LLAMA, NAMES)
    chunks = []
    for ch in text[:text.index(";")]:
        chunks += stream.feed(ch)[1]
    assert [c["function"].get("name") for c in chunks if "id" in c] == ["add"]
    for ch in text[text.index(";"):]:
        chunks += stream.feed(ch)[1]
    assert stream.finish() == ("", [])
    args = {}
    for c in chunks:
        args[c["index"]] = args.get(c["index"], "") + c["function"]["arguments"]
    assert args == {0: '{"a": 1}', 1: "{}"}
    assert [(c.name, c.arguments) for c in LLAMA.parse(text, NAMES)[1]] == \
        [("add", '{"a": 1}'), ("get_weather", "{}")]
