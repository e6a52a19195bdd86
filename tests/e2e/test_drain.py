"""A rolling restart must not cut streams: `splitstack serve` receives SIGTERM mid-stream;
readiness turns false at once, new generation requests get 503 with Retry-After, liveness
stays up, the stream in flight finishes with the exact engine's tokens, and the process
then exits 0."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from models import load_model
from services.common.tokenizer import load_tokenizer
from services.engine import GenerationParams, LLMEngine
from tests.helpers.gateway import ZOO, wait_until_ready

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [504, 3575, 282, 4649, 314]
MAX_TOKENS = 96


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_the_gateway_and_the_stream_finishes():
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--model", str(ZOO),
                             "--served-model-name", "m", "--port", str(port),
                             "--dtype", "float32",              # the exact engine's tokens
                             "--drain-timeout", "120", "--log-level", "warning"], cwd=ROOT)
    try:
        wait_until_ready(proc, base)
        first, chunks = threading.Event(), []

        def stream():
            body = {"model": "m", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(line[6:])
                        first.set()
        client = threading.Thread(target=stream)
        client.start()
        assert first.wait(120)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        ready = httpx.get(base + "/ready", timeout=10)
        refused = httpx.post(base + "/v1/completions", timeout=10,
                             json={"model": "m", "prompt": "hi", "max_tokens": 2})
        health = httpx.get(base + "/health", timeout=10)
        streaming = client.is_alive()
        client.join(300)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert streaming, "the stream ended before the checks: make it longer"
    assert ready.status_code == 503 and ready.json() == {"status": "draining"}
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "draining"
    assert health.status_code == 200
    assert chunks[-1] == "[DONE]"
    text = "".join(json.loads(c)["choices"][0]["text"] for c in chunks[:-1])
    seq = LLMEngine(load_model(ZOO)).generate(
        [PROMPT], GenerationParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    assert text == load_tokenizer(ZOO).decode(seq.output_ids, skip_special_tokens=True)
