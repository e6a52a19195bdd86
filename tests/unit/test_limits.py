"""The limits checked before any work, so that one request cannot stall the server
(`services.gateway.limits`): body size and read time, the waiting-queue bound, the request
caps, prompts refused by their length before tokenizing, and tokenizing off the event loop.

The gateway runs in process (httpx's ASGI transport) over SmolLM2's tokenizer and an
engine that plays back tokens."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from prometheus_client import CollectorRegistry

from services.common.tokenizer import load_tokenizer
from services.gateway.app import build_app
from services.gateway.gateway import Gateway
from services.gateway.limits import (DRAIN_BYTES, MAX_LOGIT_BIAS, MAX_SEQUENCES, MAX_STOP_CHARS,
                                     MAX_STOPS, BodyLimit, HttpLimits, LimitMetrics,
                                     PromptBound)
from tests.helpers.gateway import ZOO
from tests.helpers.held_engine import HeldEngine

MAX_MODEL_LEN = 512


class CountingTokenizer:
    """SmolLM2's tokenizer, recording the threads that tokenize."""

    def __init__(self, tokenizer):
        self.inner, self.threads = tokenizer, []

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self):
        return len(self.inner)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ZOO)


def app_with(tokenizer, limits=HttpLimits(), slots=16, engine=None):
    gateway = Gateway(engine or HeldEngine(), CountingTokenizer(tokenizer), "m", MAX_MODEL_LEN)
    return build_app(gateway, limits=limits, running_slots=slots)


def post(app, path, body=None, **kwargs):
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, json=body, **kwargs)
    return asyncio.run(run())


def refusals(app) -> dict[str, float]:
    return {s.labels["reason"]: s.value for m in app.state.limit_metrics.refusals.collect()
            for s in m.samples if s.name.endswith("_total")}


def test_body_over_the_cap_is_413_before_it_is_read(tokenizer):
    app = app_with(tokenizer, HttpLimits(max_body_bytes=1000))
    r = post(app, "/v1/completions", {"model": "m", "prompt": "x" * 2000})
    # the connection stays: the server discards the rest of the body unread
    assert r.status_code == 413 and "connection" not in r.headers
    assert r.json()["error"]["code"] == "body_too_large" and "1000" in r.json()["error"]["message"]

    async def chunks():                      # chunked: no Content-Length to judge by
        for _ in range(20):
            yield b" " * 100
    r = post(app, "/v1/completions", content=chunks())
    assert r.status_code == 413
    assert refusals(app) == {"body_too_large": 2}
    r = post(app, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def body_limit_alone(declared: int, limits: HttpLimits) -> list[dict]:
    """The messages `BodyLimit` sends for a request declaring `declared` bytes whose body
    never comes."""
    sent = []

    async def app(scope, receive, send):
        raise AssertionError("the app must not run")

    async def run():
        async def receive():
            await asyncio.sleep(3600)

        async def send(message):
            sent.append(message)
        middleware = BodyLimit(app, limits, LimitMetrics(CollectorRegistry()))
        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(b"content-length", str(declared).encode())]}
        await asyncio.wait_for(middleware(scope, receive, send), 5)
    asyncio.run(run())
    return sent


def test_body_declared_past_the_drain_bound_is_413_and_closed():
    sent = body_limit_alone(DRAIN_BYTES + 1, HttpLimits())
    assert sent[0]["status"] == 413 and (b"connection", b"close") in sent[0]["headers"]


def test_body_not_received_in_time_is_408():
    """A client that sends its headers and then trickles (or withholds) the body."""
    sent = body_limit_alone(100, HttpLimits(body_timeout_s=0.2))
    assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
    assert b"0.2 s" in sent[1]["body"]


@pytest.mark.parametrize("body, param", [
    ({"stop": ["x"] * (MAX_STOPS + 1)}, "stop"),
    ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),
    ({"stop_token_ids": [1] * (MAX_STOPS + 1)}, "stop_token_ids"),
    ({"logit_bias": {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ({"n": 2, "prompt": ["a"] * (MAX_SEQUENCES // 2 + 1)}, "n"),
    ({"prompt": list(range(MAX_MODEL_LEN))}, "prompt"),
])
def test_caps_are_400_naming_the_field_before_tokenizing(tokenizer, body, param):
    app = app_with(tokenizer)
    r = post(app, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    gateway = app.state.gateway
    assert gateway.tokenizer.threads == [] and gateway.backend.submitted == 0


def test_a_prompt_too_long_by_its_length_is_refused_untokenized(tokenizer):
    app = app_with(tokenizer)
    bound: PromptBound = app.state.prompt_bound
    assert bound.max_chars >= max(len(tokenizer.decode([i])) for i in range(len(tokenizer)))
    text = "a" * (bound.max_chars * MAX_MODEL_LEN)
    r = post(app, "/v1/completions", {"model": "m", "prompt": text})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "at least 512 tokens" in r.json()["error"]["message"]
    r = post(app, "/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": text[:len(text) // 2]},
        {"role": "user", "content": [{"type": "text", "text": text[len(text) // 2:]}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert app.state.gateway.tokenizer.threads == []
    # shorter: tokenized (on the tokenizing thread), then the engine's own check decides
    r = post(app, "/v1/completions", {"model": "m", "prompt": "a" * (2 * MAX_MODEL_LEN),
                                      "max_tokens": 2})
    assert r.status_code == 200
    threads = app.state.gateway.tokenizer.threads
    assert len(threads) == 1 and threads[0].startswith("tokenize")


def test_tokenizing_runs_off_the_event_loop(tokenizer):
    app = app_with(tokenizer)
    for path, body in (("/v1/completions", {"prompt": ["one", "two"]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]}),
                       ("/tokenize", {"prompt": "hello"})):
        r = post(app, path, {"model": "m", "max_tokens": 2, **body})
        assert r.status_code == 200, r.text
    threads = app.state.gateway.tokenizer.threads
    assert len(threads) == 4 and all(t.startswith("tokenize") for t in threads)


def test_requests_past_the_waiting_bound_are_503_with_retry_after(tokenizer):
    engine = HeldEngine()
    app = app_with(tokenizer, HttpLimits(max_waiting_requests=1), slots=2, engine=engine)

    async def run():
        engine.hold = asyncio.Event()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            held = [asyncio.ensure_future(client.post("/v1/completions", json=body))
                    for _ in range(3)]
            while engine.submitted < 3:
                await asyncio.sleep(0.01)
            over = await client.post("/v1/completions", json=body)
            health = await client.get("/health")
            engine.hold.set()
            done = await asyncio.gather(*held)
            after = await client.post("/v1/completions", json=body)
            return over, health, done, after
    over, health, done, after = asyncio.run(run())
    assert over.status_code == 503 and over.headers["retry-after"] == "1"
    assert over.json()["error"]["code"] == "server_overloaded"
    assert health.status_code == 200
    assert [r.status_code for r in done] == [200] * 3 and after.status_code == 200
    assert refusals(app) == {"queue_full": 1}
