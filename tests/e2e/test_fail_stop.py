"""Fail stop, embedded: `splitstack serve` under `SPLITSTACK_FAULT_INJECT=engine_step:40`.
The 40th engine step raises outside the runner; the four streams open at that moment each
end with an OpenAI-style error event, a request that has not streamed yet gets a 500, new
requests get 503, `/health` and `/ready` answer 503, and the process exits non-zero."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from services.gateway.drain import EXIT_ENGINE_DEAD
from tests.e2e.test_drain import ROOT, free_port
from tests.helpers.gateway import ZOO, wait_until_ready

pytestmark = pytest.mark.slow

PROMPTS = [[504, 3575, 282, 4649, 314], [1, 2, 3, 4], [700, 800, 900], [4000, 12, 13, 14, 15]]


def test_a_fault_in_the_step_loop_fails_every_stream_and_the_server_exits():
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SPLITSTACK_FAULT_INJECT": "engine_step:40"}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--model", str(ZOO),
                             "--served-model-name", "m", "--port", str(port),
                             "--log-level", "warning"], cwd=ROOT, env=env)
    try:
        wait_until_ready(proc, base)
        started = [threading.Event() for _ in PROMPTS]

        def stream(i: int) -> tuple[int, list[dict], float]:
            body = {"model": "m", "prompt": PROMPTS[i], "max_tokens": 1000,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            events = []
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        started[i].set()
            return r.status_code, events, time.monotonic()

        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            futures = [ex.submit(stream, i) for i in range(len(PROMPTS))]
            for ev in started:
                assert ev.wait(120)
            all_open = time.monotonic()
            results = [f.result(timeout=60) for f in futures]
        ended = max(t for _, _, t in results)
        # answered while the process still runs (it exits DEAD_GRACE_S after the fault)
        health = httpx.get(base + "/health", timeout=10)
        ready = httpx.get(base + "/ready", timeout=10)
        refused = httpx.post(base + "/v1/completions", timeout=10,
                             json={"model": "m", "prompt": "hi", "max_tokens": 2})
        code = proc.wait(60)
        exited = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
    for status, events, _ in results:
        assert status == 200
        assert all("choices" in e for e in events[:-1]) and len(events) > 1   # it streamed
        error = events[-1]["error"]
        assert error["type"] == "server_error" and "the engine stopped" in error["message"]
        assert "InjectedFault" in error["message"]
    assert health.status_code == 503 and health.json() == {"status": "engine dead"}
    assert ready.status_code == 503 and ready.json() == {"status": "engine dead"}
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
    assert code == EXIT_ENGINE_DEAD
    assert ended - all_open < 30 and exited - ended < 60      # bounds on a hang, not speed
