"""The gateway's spans (`services.common.tracing`; on with `--otlp-traces-endpoint`).

- `TraceRequests` (ASGI middleware): one SERVER span per API request (`POST
  /v1/chat/completions`), in the trace its `traceparent` header names, current while the
  handler and its streamed body run, with the response's status code.
- `RequestTrace`: under it, one `llm_request` span per generated sequence, with vLLM's
  `gen_ai.*` attributes, and three children timed from what the engine reports with the
  first token: `queue` (arrival at the engine to its first scheduling), `prefill` (to the
  first token) and `decode` (to the last). The backend's call to an attention service
  runs with `llm_request` current, so the member's spans join the trace.
"""
from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.common import tracing
from services.common.messages import GenerationParams

TRACED = ("/v1/",)


class TraceRequests:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or not tracing.enabled()
                or not scope["path"].startswith(TRACED)):
            return await self.app(scope, receive, send)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        status = []

        async def send_status(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        with tracing.tracer().start_as_current_span(
                f"{scope['method']} {scope['path']}", context=tracing.extract(headers),
                kind=SpanKind.SERVER,
                attributes={"http.request.method": scope["method"],
                            "url.path": scope["path"]}) as span:
            await self.app(scope, receive, send_status)
            if status:
                span.set_attribute("http.response.status_code", status[0])
                if status[0] >= 500:
                    span.set_status(Status(StatusCode.ERROR))


class RequestTrace:
    """One sequence's `llm_request` span; `current()` while it is submitted, `first(step)`
    at its first token, `finish(...)` once it is settled."""

    def __init__(self, model: str, params: GenerationParams, prompt_tokens: int):
        self.span = tracing.tracer().start_span("llm_request", attributes={
            "gen_ai.request.model": model, "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.sampling.temperature,
            "gen_ai.request.top_p": params.sampling.top_p,
            "gen_ai.usage.prompt_tokens": prompt_tokens})
        self.context = trace.set_span_in_context(self.span)
        self.first_ns: int | None = None

    def current(self):
        return trace.use_span(self.span, end_on_exit=False)

    def first(self, step, ttft_s: float) -> None:
        if not self.span.is_recording():      # tracing off: nothing to time
            return
        self.first_ns = now = time.time_ns()
        self.span.set_attribute("gen_ai.latency.time_to_first_token", ttft_s)
        if step.queue_s is None:        # an engine that does not time its stages
            return
        prefilled = now - int(step.prefill_s * 1e9)
        queued = prefilled - int(step.queue_s * 1e9)
        for name, start, end in (("queue", queued, prefilled), ("prefill", prefilled, now)):
            tracing.tracer().start_span(name, context=self.context,
                                        start_time=start).end(end_time=end)
        self.span.set_attribute("gen_ai.latency.time_in_queue", step.queue_s)
        self.span.set_attribute("gen_ai.latency.time_in_model_prefill", step.prefill_s)

    def finish(self, outcome: str, completion_tokens: int, e2e_s: float) -> None:
        if not self.span.is_recording():
            return
        now = time.time_ns()
        if self.first_ns is not None:
            tracing.tracer().start_span("decode", context=self.context,
                                        start_time=self.first_ns).end(end_time=now)
            self.span.set_attribute("gen_ai.latency.time_in_model_decode",
                                    (now - self.first_ns) / 1e9)
        self.span.set_attribute("gen_ai.usage.completion_tokens", completion_tokens)
        self.span.set_attribute("gen_ai.response.finish_reasons", [outcome])
        self.span.set_attribute("gen_ai.latency.e2e", e2e_s)
        if outcome == "error":
            self.span.set_status(Status(StatusCode.ERROR))
        self.span.end(end_time=now)
