"""Over HTTP with SmolLM2: what a client gets wrong is a 400
with an OpenAI-style body naming the field (never a 500, never FastAPI's `{"detail": ...}`),
and `GET /v1/models/{model}` answers as OpenAI's does."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers.gateway import MODEL, client, wait_idle

pytestmark = pytest.mark.slow


def post(base: str, path: str, body) -> httpx.Response:
    """`body` as Python's JSON writes it: NaN, and lone surrogates as `\\ud800` escapes."""
    return httpx.post(base + path, content=json.dumps(body).encode(), timeout=60,
                      headers={"content-type": "application/json"})


def error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def chat(content) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                         "logit_bias": {"\u0663": 1}}, "logit_bias"),
    ("/v1/chat/completions", chat([{"type": "text", "text": 5}]), "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", chat("a\ud800b"), "messages"),
    # was silently an empty message
    ("/v1/chat/completions", chat([{"type": "text"}]), "messages"),
])
def test_the_issues_500s_are_400s_naming_the_field(server, path, body, param):
    """Finding 3: each of these was a 500."""
    base, gateway = server
    resp = post(base, path, body)
    assert resp.status_code == 400, resp.text
    err = error(resp)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert httpx.get(base + "/health").status_code == 200
    eng = wait_idle(gateway)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_messages_name_the_parameter_sent(server):
    """Finding 5: a NaN temperature "should be ≤ 2"; max_completion_tokens reported as
    max_tokens."""
    base, _ = server
    resp = post(base, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                          "temperature": float("nan")})
    err = error(resp)
    assert resp.status_code == 400 and err["param"] == "temperature"
    assert "finite" in err["message"] and "less than" not in err["message"]
    for value in (0, 100_000):
        resp = post(base, "/v1/chat/completions", {**chat("hi"), "max_tokens": None,
                                                   "max_completion_tokens": value})
        err = error(resp)
        assert resp.status_code == 400 and err["param"] == "max_completion_tokens", err
        assert "max_tokens" not in err["message"]


def test_a_body_that_fails_to_parse_gets_the_openai_shape(server):
    """Finding 5: bytes that are not UTF-8 got `{"detail": ...}`."""
    base, _ = server
    for raw in (b'{"model": "\xff"}', b"{not json"):
        resp = httpx.post(base + "/v1/completions", content=raw,
                          headers={"content-type": "application/json"})
        assert resp.status_code == 400 and error(resp)["param"] is None
    resp = httpx.get(base + "/v1/nothing")
    assert resp.status_code == 404 and "/v1/nothing" in error(resp)["message"]


def test_models_retrieve(server):
    """Finding 5: `GET /v1/models/{model}` (the `openai` client's `models.retrieve`)."""
    base, gateway = server
    c = client(base)
    model = c.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    assert model.model_extra["max_model_len"] == gateway.max_model_len
    with pytest.raises(openai.NotFoundError) as caught:
        c.models.retrieve("gpt-4")
    assert caught.value.body["param"] == "model"
    assert caught.value.body["code"] == "model_not_found"
