"""Generated clients trust the schema: `/openapi.json` declares the responses the gateway really gives
(400, 401, 404, 408, 413, 429, 503 with the OpenAI error body; no 422, which it never sends) and
the media types it sends (SSE streams, `/metrics` as text), and `GET /v1/models/{model}`."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from services.common.tokenizer import load_tokenizer
from services.gateway.app import build_app
from services.gateway.gateway import Gateway
from tests.helpers.gateway import ZOO
from tests.helpers.playback import PlaybackEngine

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def app():
    gateway = Gateway(PlaybackEngine([504, 3575]), load_tokenizer(ZOO), MODEL, 2048)
    return build_app(gateway, api_key="k")


@pytest.fixture(scope="module")
def doc(app):
    with TestClient(app) as c:
        return c.get("/openapi.json").json()


def test_error_statuses_are_declared_with_the_error_body(doc):
    paths = doc["paths"]
    want = {("/v1/completions", "post"): {400, 401, 404, 408, 413, 429, 503},
            ("/v1/chat/completions", "post"): {400, 401, 404, 408, 413, 429, 503},
            ("/v1/models", "get"): {401, 408, 429},
            ("/v1/models/{model}", "get"): {401, 404, 408, 429},
            ("/tokenize", "post"): {400, 404, 408, 413, 429},
            ("/detokenize", "post"): {400, 404, 408, 413, 429},
            ("/health", "get"): {408, 429},
            ("/metrics", "get"): {408, 429}}
    for (path, method), statuses in want.items():
        responses = paths[path][method]["responses"]
        assert statuses <= {int(s) for s in responses}, (path, responses)
        for s in statuses:
            body = responses[str(s)]["content"]["application/json"]["schema"]
            assert body == {"$ref": "#/components/schemas/ErrorResponse"}
        for s in {429, 503} & statuses:
            assert "Retry-After" in responses[str(s)]["headers"]
    error = doc["components"]["schemas"]["ErrorResponse"]
    assert set(error["properties"]["error"]["required"]) == {"message", "type", "param",
                                                             "code"}
    assert not any("422" in op["responses"] for ops in paths.values() for op in ops.values())
    assert "HTTPValidationError" not in doc["components"]["schemas"]


def test_media_types(doc):
    paths = doc["paths"]
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        ok = paths[path]["post"]["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(ok)
    assert "503" in paths["/health"]["get"]["responses"]


def test_the_declared_errors_are_the_ones_answered(app, doc):
    """What the app answers for a wrong key, a bad body, an unknown model is declared for
    that route, with a body of the declared shape."""
    with TestClient(app) as c:
        auth = {"Authorization": "Bearer k"}
        cases = [("post", "/v1/completions", {"model": MODEL, "prompt": 5}, auth, 400),
                 ("post", "/v1/completions", {"model": "x", "prompt": "hi"}, auth, 404),
                 ("post", "/v1/chat/completions", {"model": MODEL}, {}, 401),
                 ("get", "/v1/models/x", None, auth, 404),
                 ("get", "/v1/models/" + MODEL, None, auth, 200),
                 ("post", "/tokenize", {"model": MODEL, "messages": []}, {}, 400)]
        for method, path, body, headers, status in cases:
            resp = c.request(method.upper(), path, json=body, headers=headers)
            assert resp.status_code == status, (path, resp.text)
            route = "/v1/models/{model}" if path.startswith("/v1/models/") else path
            assert str(status) in doc["paths"][route][method]["responses"]
            if status != 200:
                assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
