"""Request tracing across real hops: a gateway over HTTP, an attention service and a prefill
replica over gRPC (every server in this process, one OpenTelemetry SDK provider with its
in-memory exporter). A request that arrives with a W3C `traceparent` gets one trace: the
gateway's HTTP span under the client's, `llm_request` with its queue, prefill and decode
children, the attention service's span under `llm_request` and the prefill replica's under
that; with tracing off nothing is recorded and no trace context is sent."""
from __future__ import annotations

import time

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry

from models import load_model
from services.attention.client import AttentionClient
from services.attention.runner import qfirst_engine
from services.attention.server import serve_attention
from services.common import tracing
from services.common.tokenizer import load_tokenizer
from services.deployment.build import EngineOptions, build_engine
from services.deployment.transports import make_transport
from services.gateway.app import build_app
from services.gateway.gateway import Gateway
from services.mlp_pool import MLPPool
from services.prefill.client import PrefillClient
from services.prefill.server import serve_prefill
from tests.helpers.gateway import ZOO, running

pytestmark = pytest.mark.slow

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{CLIENT_SPAN:016x}-01"


@pytest.fixture
def stack(tiny_checkpoint):
    """A gateway (HTTP) over an attention service whose prompts a prefill replica
    prefills (gRPC), all in this process."""
    path, _ = tiny_checkpoint("llama3")
    model = load_model(path)
    registry = CollectorRegistry()
    engine, _ = build_engine(model, path, EngineOptions(kv_cache_bytes=8 << 20), registry)
    prefill_server, prefill_address, prefill_loop = serve_prefill(engine, registry)
    client = PrefillClient([prefill_address], model.config, model.dtype)
    attention = qfirst_engine(model, make_transport("local", [MLPPool(model)]), block_size=4,
                              num_blocks=64)
    server, address, loop = serve_attention(attention, prefill=client)
    backend = AttentionClient([address])
    app = build_app(Gateway(backend, load_tokenizer(ZOO), "tiny", 256))
    try:
        with running(app) as base:
            yield base
    finally:
        backend.shutdown()
        for s, lp in ((server, loop), (prefill_server, prefill_loop)):
            s.stop(0)
            lp.shutdown()


def complete(base: str, headers: dict) -> dict:
    r = httpx.post(base + "/v1/completions", headers=headers, timeout=120, json={
        "model": "tiny", "prompt": [5, 17, 33, 9, 41, 2, 8], "max_tokens": 5,
        "ignore_eos": True, "stream": True})
    assert r.status_code == 200, r.text
    return r


def test_one_trace_spans_gateway_attention_service_and_prefill_replica(stack, monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_provider", None)        # restored after the test
    complete(stack, {})
    assert exporter.get_finished_spans() == () and tracing.inject() == []   # off
    tracing.configure(None, "test", provider=provider)
    complete(stack, {"traceparent": TRACEPARENT})
    # the HTTP span ends once the response's last bytes are sent: the client may have read
    # them a moment before
    deadline = time.monotonic() + 30
    while len(exporter.get_finished_spans()) < 7 and time.monotonic() < deadline:
        time.sleep(0.01)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"POST /v1/completions", "llm_request", "queue", "prefill", "decode",
                          "attention_generate", "prefill_replica"}
    assert {s.context.trace_id for s in spans.values()} == {TRACE_ID}   # the client's trace
    parent = {name: s.parent.span_id for name, s in spans.items()}
    http, request = spans["POST /v1/completions"], spans["llm_request"]
    assert http.kind == SpanKind.SERVER and parent["POST /v1/completions"] == CLIENT_SPAN
    assert http.attributes["http.response.status_code"] == 200
    assert parent["llm_request"] == http.context.span_id
    for child in ("queue", "prefill", "decode", "attention_generate"):
        assert parent[child] == request.context.span_id, child
    assert parent["prefill_replica"] == spans["attention_generate"].context.span_id
    assert spans["attention_generate"].kind == spans["prefill_replica"].kind == SpanKind.SERVER
    # the stages follow each other, within the request
    queue, prefill, decode = spans["queue"], spans["prefill"], spans["decode"]
    assert request.start_time <= queue.start_time <= queue.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time <= decode.end_time == request.end_time
    assert request.attributes["gen_ai.usage.prompt_tokens"] == 7
    assert request.attributes["gen_ai.usage.completion_tokens"] == 5
    assert list(request.attributes["gen_ai.response.finish_reasons"]) == ["length"]
    assert spans["prefill_replica"].attributes["gen_ai.usage.prompt_tokens"] == 7
