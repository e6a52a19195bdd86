"""Request tracing, as vLLM's `--otlp-traces-endpoint`: OpenTelemetry spans of a request's
way through the deployment, exported over OTLP (gRPC) by each process that serves a part of
it (the gateway, an attention service, a prefill replica).

The W3C trace context (`traceparent`) comes into the gateway with a request's HTTP headers
(a client's own trace goes on), and travels from there in gRPC metadata: to the attention
service that runs the request, and on to the prefill replica that prefills its prompt.
Until `configure` is called, spans are OpenTelemetry's no-ops and nothing is exported.
"""
from __future__ import annotations

import atexit
from collections.abc import Iterable

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

_provider: TracerProvider | None = None
NO_OP = trace.NoOpTracerProvider()


def configure(endpoint: str | None, service: str,
              provider: TracerProvider | None = None) -> None:
    """Export this process's spans to the OTLP/gRPC collector at `endpoint` (e.g.
    `http://otel-collector:4317`; `https://` for TLS), as `service.name` `service`; or into
    `provider` (tests: the SDK's in-memory exporter). No endpoint and no provider: off."""
    global _provider
    if provider is None:
        if not endpoint:
            return
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        atexit.register(provider.shutdown)       # what is still batched goes out
    _provider = provider


def enabled() -> bool:
    return _provider is not None


def tracer() -> trace.Tracer:
    return (_provider or NO_OP).get_tracer("splitstack")


def inject() -> list[tuple[str, str]]:
    """The current trace context as gRPC metadata (`traceparent`, ...): empty when no span
    is current or tracing is off."""
    if _provider is None:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


def extract(metadata: Iterable[tuple[str, str]] | None) -> Context:
    """The trace context a caller sent in gRPC metadata or HTTP headers (lower-case keys)."""
    return propagate.extract(dict(metadata or ()))
