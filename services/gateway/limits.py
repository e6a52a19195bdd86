"""What the gateway refuses before it does any work, and how it keeps its event loop free.

Checked in this order, each as cheaply as it can be:

1. connections: per client address, and the time a client has to send its headers
   (`services.gateway.http_server`, before any request exists);
2. `BodyLimit`: a body over `max_body_bytes` is 413, by its Content-Length before a byte
   is read, or as soon as a chunked body passes the cap; a body not received within
   `body_timeout_s` is 408. The server discards the rest of a refused body unread (a
   client that sends its whole body before it reads gets the 413 rather than a reset),
   unless it is declared over `DRAIN_BYTES` or chunked: then the connection closes;
3. `AdmissionQueue`: generation requests past the engines' running slots plus
   `max_waiting_requests` are 503 with Retry-After;
4. `check_request`: `n` × prompts, `stop`, `stop_token_ids` and `logit_bias` entries, and
   prompts that cannot fit the context judging by their length alone (`PromptBound`),
   400 naming the field, before anything is tokenized;
5. tokenization and chat templates run on a worker thread (`off_loop`): `/health` and
   every stream keep their latency while a large prompt is tokenized.

Every refusal has an OpenAI-style body and is counted in
`splitstack_http_refusals_total{reason}`.
"""
from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

from fastapi.responses import JSONResponse
from prometheus_client import Counter

from services.gateway.protocol import APIError, ChatCompletionRequest

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
MAX_SEQUENCES = 128        # engine requests one HTTP request may start: candidates × prompts
MAX_STOPS = 32             # entries of `stop` and of `stop_token_ids`
MAX_STOP_CHARS = 1024      # one stop string (each costs its length per stream)
MAX_LOGIT_BIAS = 300       # entries of `logit_bias`
DRAIN_BYTES = 64 << 20     # a refused body up to this size is discarded, not cut off

# tokenization and chat templates of request prompts; the fast tokenizer releases the GIL
_TOKENIZE = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0           # to receive a whole body once its headers came
    header_timeout_s: float = 10.0         # from connection (or a request's first byte)
    keep_alive_s: int = 5                  # an idle kept-alive connection is closed after
    max_connections_per_client: int = 64   # open connections from one client address
    max_waiting_requests: int = 64         # generation requests beyond the running slots

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            # max_waiting_requests may be 0: nothing waits beyond the running slots
            least, what = (0, "≥ 0") if f.name == "max_waiting_requests" else (1e-9, "> 0")
            if isinstance(value, bool) or not value >= least:
                raise ValueError(f"{f.name} must be {what}, got {value!r}")


class LimitMetrics:
    def __init__(self, registry):
        self.refusals = Counter("splitstack_http_refusals_total",
                                "Requests and connections refused before any work, by reason",
                                ["reason"], registry=registry)


async def refuse(scope, receive, send, error: APIError, reason: str, metrics: LimitMetrics,
                 retry_after: float | None = None, close: bool = False) -> None:
    """Answer with `error`'s body; `close`: the connection ends after it (its unread
    body is never read)."""
    metrics.refusals.labels(reason).inc()
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    if close:
        headers["Connection"] = "close"
    await JSONResponse(error.body(), status_code=error.status, headers=headers)(
        scope, receive, send)


class BodyLimit:
    """ASGI middleware: reads each request body whole, within `max_body_bytes` and
    `body_timeout_s`, then hands it to the app. The body is buffered once (the app would
    buffer it anyway); after it, `receive` is the server's again (disconnects)."""

    def __init__(self, app, limits: HttpLimits, metrics: LimitMetrics):
        self.app, self.limits, self.metrics = app, limits, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is None and b"transfer-encoding" not in headers:
            return await self.app(scope, receive, send)      # no body (a GET, say)
        cap = self.limits.max_body_bytes
        if length is not None and length.isdigit() and int(length) > cap:
            return await refuse(scope, receive, send, self._too_large(int(length)),
                                "body_too_large", self.metrics,
                                close=int(length) > DRAIN_BYTES)
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except TimeoutError:
                error = APIError(408, f"the request body did not arrive within "
                                      f"{self.limits.body_timeout_s:g} s",
                                 code="request_timeout")
                return await refuse(scope, receive, send, error, "body_timeout", self.metrics,
                                    close=True)
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > cap:
                chunks.clear()
                return await refuse(scope, receive, send, self._too_large(size),
                                    "body_too_large", self.metrics, close=True)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        chunks.clear()
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    def _too_large(self, size: int) -> APIError:
        return APIError(413, f"the request body has {'at least ' if size else ''}{size} bytes, "
                             f"more than this server's limit of {self.limits.max_body_bytes}",
                        code="body_too_large")


class AdmissionQueue:
    """ASGI middleware: at most `slots + waiting` generation requests in flight, from
    their headers to the end of their response (a stream's last byte); past that, 503
    with Retry-After. `slots`: requests the engines run at once; the rest wait in the
    engines' queues, so the queue is bounded by `waiting` (plus their `n` × prompts)."""

    def __init__(self, app, slots: int, waiting: int, metrics: LimitMetrics):
        self.app, self.limit, self.metrics = app, slots + waiting, metrics
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            error = APIError(503, f"the server is at capacity ({self.limit} requests running "
                                  f"or waiting); retry later", type_="server_error",
                             code="server_overloaded")
            return await refuse(scope, receive, send, error, "queue_full", self.metrics,
                                retry_after=1)
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class PromptBound:
    """The fewest tokens a text can have: no token covers more than `max_chars` characters
    (the longest vocabulary entry, in raw or decoded form; doubled when a normalizer could
    shorten the text), so a text of n characters has at least n // max_chars tokens. A
    prompt refused by that needs no tokenizing."""

    def __init__(self, tokenizer, max_model_len: int):
        raw = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        longest = max(max(len(t or "") for t in raw),
                      max(len(tokenizer.convert_tokens_to_string([t])) for t in raw if t))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        normalizer = backend is None or backend.normalizer is not None
        self.max_chars = max(1, longest) * (2 if normalizer else 1)
        self.max_model_len = max_model_len

    def check(self, chars: int, tokens_at_least: int, param: str) -> None:
        """A prompt (`chars` long, or `tokens_at_least` ids) must leave room for one
        generated token."""
        fewest = max(tokens_at_least, chars // self.max_chars)
        if fewest >= self.max_model_len:
            what = f"{chars} characters, so at least " if chars else ""
            raise APIError(400, f"the prompt has {what}{fewest} tokens; the context length "
                                f"is {self.max_model_len}, prompt and completion included",
                           param)


def check_request(request, req) -> None:
    """The caps, and prompts too long by their length alone, before any tokenizing
    (`request.app.state.prompt_bound`, set by `install`)."""
    bound: PromptBound = request.app.state.prompt_bound
    stops = req.stop_list()
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise APIError(400, f"a stop string has at most {MAX_STOP_CHARS} characters, got "
                            f"{longest}", "stop")
    if len(req.stop_token_ids or ()) > MAX_STOPS:
        raise APIError(400, f"stop_token_ids takes at most {MAX_STOPS} ids, got "
                            f"{len(req.stop_token_ids)}", "stop_token_ids")
    if len(req.logit_bias or ()) > MAX_LOGIT_BIAS:
        raise APIError(400, f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got "
                            f"{len(req.logit_bias)}", "logit_bias")
    # by type: a completions body may carry an extra field named "messages"
    if isinstance(req, ChatCompletionRequest):
        # a chat template keeps each message's text, trimmed at most
        bound.check(sum(len(m.text().strip()) for m in req.messages), 0, "messages")
        return
    prompts = req.prompts()
    sequences = len(prompts) * req.candidates()
    if sequences > MAX_SEQUENCES:
        raise APIError(400, f"n × prompts is at most {MAX_SEQUENCES} completions per request, "
                            f"got {req.candidates()} × {len(prompts)}", "n")
    for p in prompts:
        bound.check(len(p) if isinstance(p, str) else 0,
                    0 if isinstance(p, str) else len(p), "prompt")


async def off_loop(fn, *args):
    """`fn(*args)` on the tokenizing thread (tokenizers, chat templates)."""
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZE, fn, *args)


def install(app, limits: HttpLimits, running_slots: int) -> None:
    """The body and queue middlewares (outermost first: body, then queue) and what
    `check_request` reads; the counters go on the gateway's registry."""
    gateway = app.state.gateway
    metrics = LimitMetrics(gateway.metrics.registry)
    app.state.limit_metrics = metrics
    app.state.prompt_bound = PromptBound(gateway.tokenizer, gateway.max_model_len)
    app.add_middleware(AdmissionQueue, slots=running_slots,
                       waiting=limits.max_waiting_requests, metrics=metrics)
    app.add_middleware(BodyLimit, limits=limits, metrics=metrics)
