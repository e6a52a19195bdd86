"""The request validators, property-tested: a bad body is a 4xx naming its field.

Random JSON bodies, sent through the gateway's FastAPI app in process (SmolLM2's tokenizer and
chat template; an engine that refuses what `LLMEngine.validate` refuses and answers two
tokens), get either an answer or a 4xx whose OpenAI-style body names a field, never a 500:
- a valid body with one field replaced by any JSON value is answered, or refused naming
  that field (404 for an unknown model);
- any body of known fields gets an answer or a refusal naming one of its fields (or a
  required one it lacks).
The issue's cases are pinned as explicit examples.
"""
from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from services.common.messages import RequestError, StepOutput, check_request
from services.common.tokenizer import load_tokenizer
from services.gateway.app import build_app
from services.gateway.gateway import Gateway
from services.gateway.protocol import (ChatCompletionRequest, CompletionRequest,
                                       DetokenizeRequest, TokenizeRequest)
from tests.helpers.gateway import ZOO
from tests.helpers.playback import PlaybackEngine

MODEL = "smollm2-135m"
CONTEXT = 2048
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


class ValidatingEngine(PlaybackEngine):
    """Refuses what `LLMEngine.validate` refuses (vocabulary, context length); answers
    with its tokens, and the log-probs asked for."""

    def __init__(self, vocab_size: int):
        super().__init__([504, 3575])
        self.vocab_size = vocab_size

    async def submit(self, prompt_ids, params):
        check_request(prompt_ids, params, self.vocab_size)
        if len(prompt_ids) + params.max_tokens > CONTEXT:
            raise RequestError("max_tokens", params.max_tokens, "exceeds the context length")
        out: asyncio.Queue = asyncio.Queue()
        tokens = self.tokens[:params.max_tokens]
        for i, t in enumerate(tokens):
            last = i == len(tokens) - 1
            top = None if params.logprobs is None else [(t, -0.5)] * params.logprobs
            out.put_nowait(StepOutput(0, t, -0.5, last, "length" if last else None,
                                      top_logprobs=top))
        return 0, out


@pytest.fixture(scope="module")
def http():
    tokenizer = load_tokenizer(ZOO)
    gateway = Gateway(ValidatingEngine(len(tokenizer)), tokenizer, MODEL, CONTEXT)
    with TestClient(build_app(gateway)) as client:   # a 500 raises in the test
        yield client


def post(http, path: str, body) -> tuple[int, dict]:
    resp = http.post(path, content=json.dumps(body).encode(),
                     headers={"content-type": "application/json"})
    if resp.headers["content-type"].startswith("text/event-stream"):
        return resp.status_code, {"stream": resp.text}
    return resp.status_code, resp.json()


def refusal(status: int, body: dict) -> str | None:
    """The `param` of an OpenAI-style error body (checking its shape)."""
    assert 400 <= status < 500, (status, body)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["type"] == "invalid_request_error", err
    return err["param"]


# any JSON value Python's parser reads: NaN, ±Infinity, big integers, lone surrogates,
# digits of other scripts, nested containers
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
           | st.text(max_size=6)
           | st.sampled_from(["a\ud800b", "\udfff", "\u0663", "\u00b2", "", " 7 ", "text"]))
# and values a field may well take, so that valid bodies reach generation too
plausible = (st.integers(-2, 20) | st.floats(-1, 3) | st.booleans()
             | st.lists(st.integers(0, 49151), max_size=3)
             | st.sampled_from(["exact", "ridgefill", "\n", "text", "auto", "none"])
             | st.dictionaries(st.sampled_from(["5", "100", "include_usage", "type"]),
                               st.integers(-5, 5) | st.booleans(), max_size=2))
values = plausible | st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6) | st.sampled_from(
                          ["type", "text", "role", "content", "include_usage", "5"]),
                          inner, max_size=3), max_leaves=8)

BASES = {
    "/v1/completions": ({"model": MODEL, "prompt": "The capital of France is",
                         "max_tokens": 2}, CompletionRequest),
    "/v1/chat/completions": ({"model": MODEL, "messages": CHAT, "max_tokens": 2},
                             ChatCompletionRequest),
    "/tokenize": ({"model": MODEL, "prompt": "hi"}, TokenizeRequest),
    "/detokenize": ({"model": MODEL, "tokens": [504, 3575]}, DetokenizeRequest),
}
EXTRA = ["echo", "best_of", "suffix", "tools", "tool_choice", "response_format",
         "top_logprobs", "user", "messages", "prompt"]
paths = st.sampled_from(sorted(BASES))


@st.composite
def one_field_changed(draw):
    path = draw(paths)
    cls = BASES[path][1]
    field = draw(st.sampled_from(sorted(set(cls.model_fields) | set(EXTRA))))
    return path, field, draw(values)


def answered(path: str, body: dict) -> None:
    if path in ("/v1/completions", "/v1/chat/completions") and "stream" not in body:
        assert body["choices"] and body["usage"]["completion_tokens"] >= 1, body


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=one_field_changed())
# the issue's
@example(case=("/v1/completions", "logit_bias", {"\u0663": 1}))
@example(case=("/v1/chat/completions", "messages",
               [{"role": "user", "content": [{"type": "text", "text": 5}]}]))
@example(case=("/v1/chat/completions", "messages",
               [{"role": "user", "content": [{"type": "text"}]}]))
@example(case=("/v1/completions", "prompt", "a\ud800b"))
@example(case=("/v1/chat/completions", "messages", [{"role": "user", "content": "a\ud800b"}]))
@example(case=("/v1/completions", "temperature", float("nan")))
@example(case=("/v1/chat/completions", "max_completion_tokens", 0))
@example(case=("/v1/chat/completions", "max_completion_tokens", 5000))
@example(case=("/v1/completions", "ridgefill", {"split": 4}))
def test_one_wrong_field_is_the_one_named(http, case):
    path, field, value = case
    status, answer = post(http, path, {**BASES[path][0], field: value})
    event(f"{path} {status}")
    if status == 200:
        answered(path, answer)
        return
    param = refusal(status, answer)
    # /tokenize takes prompt or messages: both given is reported under prompt
    both = path == "/tokenize" and {field, param} == {"prompt", "messages"}
    assert param == field or (status == 404 and param == "model") or both, (field, answer)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=paths, data=st.data())
def test_any_body_gets_an_answer_or_a_refusal_naming_its_field(http, path, data):
    _, cls = BASES[path]
    keys = st.sampled_from(sorted(set(cls.model_fields) | set(EXTRA)))
    body = data.draw(st.dictionaries(keys, values, max_size=6) | values)
    status, answer = post(http, path, body)
    event(f"{path} {status}")
    if status == 200:
        return answered(path, answer)
    param = refusal(status, answer)
    if not isinstance(body, dict):
        assert param is None
        return
    required = {n for n, f in cls.model_fields.items() if f.is_required()}
    assert param in set(body) | required, (body, answer)


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"\u0663": 1}},
     "logit_bias"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text"}]}]}, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["ok", "a\ud800b"]}, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "a\ud800b"}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a\ud800b"}]}]}, "messages"),
    ("/tokenize", {"model": MODEL, "prompt": "a\ud800b"}, "prompt"),
])
def test_the_issues_bodies_are_400s_naming_the_field(http, path, body, param):
    """Each was a 500 (or, for a part without `text`, silently an empty message)."""
    status, answer = post(http, path, body)
    assert status == 400 and refusal(status, answer) == param, answer


def test_messages_name_the_parameter_sent(http):
    """A NaN temperature is "not finite", not "should be ≤ 2"; chat's
    `max_completion_tokens` is reported under its own name."""
    status, answer = post(http, "/v1/completions", {**BASES["/v1/completions"][0],
                                                    "temperature": float("nan")})
    assert refusal(status, answer) == "temperature"
    assert "finite" in answer["error"]["message"] and "2" not in answer["error"]["message"]
    for value in (0, 5000):
        status, answer = post(http, "/v1/chat/completions", {
            "model": MODEL, "messages": CHAT, "max_completion_tokens": value})
        assert refusal(status, answer) == "max_completion_tokens", answer
        assert "max_tokens" not in answer["error"]["message"]


def test_a_body_that_fails_to_parse_gets_the_openai_shape(http):
    """Finding 5: not FastAPI's `{"detail": ...}`: bad JSON, bytes that are not UTF-8, a
    route or method that does not exist."""
    for raw in (b"{not json", b'{"model": "\xff"}', b"[" * 100_000):
        resp = http.post("/v1/completions", content=raw,
                         headers={"content-type": "application/json"})
        assert refusal(resp.status_code, resp.json()) is None
    for method, path in (("GET", "/v1/nothing"), ("DELETE", "/v1/models")):
        resp = http.request(method, path)
        assert resp.status_code in (404, 405) and path in resp.json()["error"]["message"]
