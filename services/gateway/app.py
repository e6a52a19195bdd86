"""OpenAI-compatible HTTP gateway (FastAPI): the routes, API-key check and error bodies.

The endpoints live beside it: `completions.py` and `chat.py` (whole or SSE-streamed, over
`serving.py`), on top of `gateway.py` (request -> engine, outputs -> text deltas).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException

from services.gateway.admin import install as install_admin
from services.gateway.chat import create_chat_completion
from services.gateway.responses import (ResponsesRequest, ResponseStore, create_response,
                                        retrieve_response)
from services.gateway.completions import create_completion
from services.gateway.gateway import Gateway
from services.gateway.http_metrics import install as install_http_metrics
from services.gateway.limits import HttpLimits, off_loop
from services.gateway.limits import install as install_limits
from services.gateway.tracing import TraceRequests
from services.gateway.openapi import document
from services.gateway.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                       DetokenizeRequest, TokenizeRequest, validation_error)
from services.gateway.ratelimit import RateLimits
from services.gateway.ratelimit import install as install_rate_limits

__all__ = ["Gateway", "RequireAPIKey", "build_app"]

log = logging.getLogger(__name__)


class RequireAPIKey:
    """ASGI middleware: the `/v1/` routes need `Authorization: Bearer <key>` (vLLM's
    `--api-key`), the `/admin/` routes their own `admin_key` (the client key does not open
    them; without an admin key they take the client key); `/health`, `/ready` and `/metrics`
    stay open for probes and scrapers. Pure ASGI, so streamed responses and disconnects pass
    through untouched."""

    def __init__(self, app, key: str | None, admin_key: str | None = None):
        self.app = app
        admin_key = admin_key or key
        self.expected = {prefix: f"Bearer {k}".encode()
                         for prefix, k in (("/v1/", key), ("/admin/", admin_key)) if k}

    async def __call__(self, scope, receive, send):
        expected = next((v for prefix, v in self.expected.items()
                         if scope["type"] == "http" and scope["path"].startswith(prefix)), None)
        if expected is not None:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, expected):
                error = APIError(401, "missing or invalid API key: send 'Authorization: Bearer "
                                      "<key>'", code="invalid_api_key")
                response = JSONResponse(error.body(), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


@contextlib.asynccontextmanager
async def polling(backend, app):
    """While the server runs: a backend whose `refresh` calls other processes is polled
    every `poll_interval_s` here, so a scrape of /metrics reads what the last poll saw and
    never waits on an unreachable member."""
    async def poll():
        while True:
            try:
                await backend.refresh()
            except Exception:  # noqa: BLE001 — the next poll tries again
                log.exception("polling the engines failed")
            await asyncio.sleep(backend.poll_interval_s)

    task = asyncio.create_task(poll()) if backend.poll_interval_s is not None else None
    try:
        yield
    finally:
        if task is not None:
            task.cancel()


def build_app(gateway: Gateway, api_key: str | None = None, limits: HttpLimits | None = None,
              rate_limits: RateLimits | None = None, running_slots: int = 16,
              responses: ResponseStore | None = None,
              admin_key: str | None = None) -> FastAPI:
    """`api_key`: clients of the `/v1/` routes must send it as a bearer token; `admin_key`:
    callers of `/admin/` (default: `api_key`). `limits`:
    body size and read time, the waiting-queue bound past `running_slots` (requests the
    engines run at once) and the request caps (`services.gateway.limits`); `rate_limits`:
    per-client limits shared through Redis (`services.gateway.ratelimit`); `responses`:
    where `/v1/responses` keeps responses (default: in this process, for an hour)."""
    app = FastAPI(title="splitstack", lifespan=functools.partial(polling, gateway.backend))
    app.state.gateway = gateway
    install_limits(app, limits or HttpLimits(), running_slots)
    install_admin(app)          # /admin/pools, /ready, and the drain on SIGTERM
    if rate_limits is not None and rate_limits.enabled:
        install_rate_limits(app, rate_limits)
    if api_key or admin_key:
        app.add_middleware(RequireAPIKey, key=api_key, admin_key=admin_key)
    install_http_metrics(app)   # counts every response, refusals included
    app.add_middleware(TraceRequests)   # outermost: a span per API request (when tracing)

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def refused_body(_, exc: RequestValidationError):
        return JSONResponse(validation_error(exc.errors()).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        """Starlette's own refusals (no such route or method, a body that is not UTF-8) in
        the OpenAI shape too, rather than `{"detail": ...}`."""
        where = f" ({request.method} {request.url.path})" if exc.status_code in (404, 405) else ""
        error = APIError(exc.status_code, f"{exc.detail}{where}",
                         type_="invalid_request_error" if exc.status_code < 500
                         else "server_error")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.get("/health")
    async def health():
        """Liveness: 503 only once the process's own engine failed stop (it exits soon);
        a gateway whose attention services are all down is alive, and not ready."""
        dead = gateway.backend.dead_since() is not None
        return JSONResponse({"status": "engine dead" if dead else "ok"},
                            status_code=503 if dead else 200)

    @app.get("/metrics")
    async def metrics():
        if gateway.backend.poll_interval_s is None:    # else polled in the background
            await gateway.backend.refresh()
        gateway.metrics.kv_usage.set(gateway.backend.kv_usage())
        gateway.metrics.running.set(gateway.backend.num_running())
        gateway.metrics.waiting.set(gateway.backend.num_waiting())
        return Response(generate_latest(gateway.metrics.registry),
                        media_type="text/plain; version=0.0.4")

    def card() -> dict:
        return {"id": gateway.model_name, "object": "model", "created": 0,
                "owned_by": "splitstack", "max_model_len": gateway.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        gateway.check_model(model)
        return card()

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        """vLLM's: the prompt's token ids (or the chat template's, for messages)."""
        gateway.check_model(req.model)
        req.check()

        def token_ids() -> list[int]:
            if req.messages is not None:
                text = gateway.tokenizer.apply_chat_template(
                    [{"role": m.role, "content": m.text()} for m in req.messages],
                    add_generation_prompt=req.add_generation_prompt, tokenize=False)
                return gateway.tokenizer(text, add_special_tokens=False)["input_ids"]
            return gateway.tokenizer(req.prompt,
                                     add_special_tokens=req.add_special_tokens)["input_ids"]

        ids = await off_loop(token_ids)        # a body-sized text takes seconds
        return {"tokens": ids, "count": len(ids), "max_model_len": gateway.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        gateway.check_model(req.model)
        vocab = len(gateway.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:4]}", "tokens")
        return {"prompt": gateway.tokenizer.decode(req.tokens)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await create_completion(gateway, req, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        return await create_chat_completion(gateway, req, request)

    store = responses or ResponseStore()
    app.state.responses = store

    @app.post("/v1/responses")
    async def create(req: ResponsesRequest, request: Request):
        return await create_response(gateway, store, req, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str):
        return await retrieve_response(store, response_id)

    document(app)
    return app
