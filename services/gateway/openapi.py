"""The OpenAPI document as the gateway answers: each route's error statuses with the
OpenAI error body, and the media types it really sends (SSE for streams, text for
`/metrics`).

FastAPI documents every body route with a 422 it never sends here (refused bodies get a
400) and every response as JSON; `document` rewrites the generated schema once, from the
table below, which is the one place a new route or status is declared.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

# status -> when a route answers it
WHEN = {
    400: "The request is malformed or asks for what this server cannot do; `param` names "
         "the field.",
    401: "Missing or invalid API key (a server started with one).",
    404: "No such model (`code`: model_not_found), or pool (`pool_not_found`; `no_pools`: "
         "the embedded deployment has none).",
    408: "The request's headers or body did not arrive in time.",
    409: "The pool cannot be resized in this deployment (`reason` in `GET /admin/pools`).",
    413: "The request body is larger than the server's cap.",
    429: "Over the client's rate limit or its cap on open connections; retry after "
         "`Retry-After` seconds.",
    500: "Generation failed inside the engine.",
    503: "No engine is serving, the waiting queue is full, or the server is draining; retry "
         "after `Retry-After` seconds.",
}
# any route, from the HTTP server's limits (`limits.py`, `http_server.py`): headers or body
# too slow, too many connections from one client
_SERVER = (408, 429)

# (path, method) -> the error statuses it can answer besides `_SERVER`'s
ROUTES: dict[tuple[str, str], tuple[int, ...]] = {
    ("/v1/completions", "post"): (400, 401, 404, 413, 500, 503),
    ("/v1/chat/completions", "post"): (400, 401, 404, 413, 500, 503),
    ("/v1/responses", "post"): (400, 401, 404, 413, 500, 503),
    ("/v1/responses/{response_id}", "get"): (401, 404),
    ("/v1/models", "get"): (401,),
    ("/v1/models/{model}", "get"): (401, 404),
    ("/tokenize", "post"): (400, 404, 413),
    ("/detokenize", "post"): (400, 404, 413),
    ("/health", "get"): (),             # its 503 has its own body (below)
    ("/ready", "get"): (),              # likewise
    ("/admin/pools", "get"): (401, 404),
    ("/admin/pools/{pool}", "put"): (400, 401, 404, 409),
    ("/metrics", "get"): (),
}

ERROR_SCHEMA = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
    }},
}
_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying",
                                "schema": {"type": "integer"}}}
_TEXT = {"schema": {"type": "string"}}
# one server-sent event, as SSE clients (and schemathesis) parse it: `data` holds a chunk's
# JSON, or `[DONE]` at the end
_SSE = {"schema": {"type": "object", "required": ["data"],
                   "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                  "id": {"type": "string"}, "retry": {"type": "integer"}}}}


def document(app: FastAPI) -> None:
    """Serves the rewritten document at `/openapi.json` (built on first request)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            declare(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def declare(schema: dict) -> None:
    """Rewrites FastAPI's generated `schema` in place from `ROUTES`."""
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorResponse"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):      # the 422 nobody gets
        schemas.pop(name, None)
    for path, methods in schema.get("paths", {}).items():
        for method, op in methods.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status in (*ROUTES.get((path, method), ()), *_SERVER):
                responses[str(status)] = {
                    "description": WHEN[status],
                    "content": {"application/json": {"schema": _ERROR_REF}},
                    **({"headers": _RETRY_AFTER} if status in (429, 503) else {}),
                }
    paths = schema.get("paths", {})
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        if path in paths:
            ok = paths[path]["post"]["responses"]["200"]
            ok["description"] = ("The completion; with `stream: true` an SSE stream of "
                                 "chunks (`data: {...}`), ending with `data: [DONE]` (the "
                                 "Responses API's: typed events, `event: ...`)")
            ok["content"]["text/event-stream"] = _SSE
    if "/metrics" in paths:
        paths["/metrics"]["get"]["responses"]["200"] = {
            "description": "Prometheus text exposition format 0.0.4",
            "content": {"text/plain": _TEXT}}
    status = {"schema": {"type": "object", "required": ["status"],
                         "properties": {"status": {"type": "string"}}}}
    for path, up, down in (("/health", "Alive (liveness)",
                            "The engine failed stop; the process exits"),
                           ("/ready", "Serving and not draining",
                            "Draining (SIGTERM), the engine failed stop, or no engine is "
                            "serving")):
        if path in paths:
            responses = paths[path]["get"]["responses"]
            responses["200"] = {"description": up, "content": {"application/json": status}}
            responses["503"] = {"description": down, "content": {"application/json": status}}
