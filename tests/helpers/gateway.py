"""A served gateway: SmolLM2 on a free loopback port, and the official `openai` client."""
from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import uvicorn

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo" / "smollm2-135m"
MODEL = "smollm2-135m"


@contextlib.contextmanager
def running(app):
    """Serve `app` with uvicorn on a free loopback port; yields the base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    try:
        yield base
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        app.state.gateway.backend.close()


@contextlib.contextmanager
def ray_deployment(**build_options):
    """The Ray deployment's gateway, on the session's Ray (request `ray_session` first): one
    attention service and one MLP pool replica over gRPC, the engine's fp32 like
    `build_embedded`'s default. Yields the base URL; on the way out, checks that the
    attention service got every KV block back."""
    import ray

    from services.deployment.ray_cluster import ClusterConfig
    from services.deployment.server import build_cluster

    config = ClusterConfig(model=str(ZOO), attention_shards=1, mlp_replicas=1, transport="grpc",
                           kv_cache_bytes=64 << 20, max_num_seqs=4)
    app, cluster = build_cluster(config, served_name=MODEL, **build_options)
    try:
        with running(app) as url:
            yield url
        deadline, blocks = time.time() + 30, []
        while time.time() < deadline:
            blocks = ray.get([a.blocks.remote() for a in cluster.attention])
            if all(free == total for free, total in blocks):
                break
            time.sleep(0.2)
        assert all(free == total for free, total in blocks), f"KV blocks leaked: {blocks}"
    finally:
        cluster.shutdown()


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def wait_idle(gateway, timeout=20.0):
    """The embedded engine once it has no request and the gateway no stream left."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        eng = gateway.backend.engine
        if not eng.has_unfinished() and not gateway.backend.streams:
            return eng
        time.sleep(0.05)
    raise AssertionError("engine still busy")


def stream_completion(base: str, prompt: list[int], max_tokens: int,
                      started: threading.Event | None = None) -> tuple[str, str | None]:
    """One greedy streamed completion through raw SSE: (text, error message or None; a
    non-200 answer, an error event or a broken connection). `started` is set at its
    first text."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text = ""
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                return "", f"HTTP {r.status_code}: {r.read()[:200]!r}"
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return text, event["error"]["message"]
                text += event["choices"][0]["text"]
                if started is not None and text:
                    started.set()
    except httpx.HTTPError as err:
        return text, f"{type(err).__name__}: {err}"
    return text, None


def metrics_urls(base: str) -> list[str]:
    """Where a deployment's series are scraped: its gateway's /metrics, and each member's
    the gateway lists for discovery (/admin/scrape-targets: the Ray deployment's)."""
    groups = httpx.get(base + "/admin/scrape-targets", timeout=30).json()
    return [base + "/metrics"] + [f"http://{t}/metrics" for g in groups for t in g["targets"]]


def deployment_metrics(base: str) -> str:
    """The deployment's series as Prometheus scrapes them (`metrics_urls`), one endpoint's
    exposition after another."""
    return "".join(httpx.get(url, timeout=30).text for url in metrics_urls(base))


def fresh_metrics(base: str, timeout_s: float = 60.0) -> str:
    """`deployment_metrics` once the gateway shows a poll of the attention services that
    began after this call (the Ray deployment polls them every 2 s, beside the scrapes); at
    once for a gateway without members. Members' own series are read when asked."""
    since, deadline = time.time(), time.monotonic() + timeout_s
    while True:
        text = httpx.get(base + "/metrics", timeout=30).text
        polled = re.search(r"^splitstack_members_polled_timestamp_seconds (\S+)$", text, re.M)
        if "splitstack_attention_up" not in text or (polled and float(polled.group(1)) >= since):
            return deployment_metrics(base)
        if time.monotonic() > deadline:
            raise AssertionError(f"no poll of the members in {timeout_s:.0f} s")
        time.sleep(0.1)


def migrations(base: str, reason: str) -> float:
    """`splitstack_migrations_total{reason}` as the gateway's /metrics shows it now."""
    found = re.search(rf'^splitstack_migrations_total\{{reason="{reason}"\}} ([\d.]+)$',
                      httpx.get(base + "/metrics", timeout=30).text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_until_ready(proc, base: str, timeout_s: float = 180) -> None:
    """Until `splitstack serve` (the process `proc`) answers `/ready` with 200."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None and time.monotonic() < deadline
        try:
            if httpx.get(base + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.3)


def reference_texts(prompts: list[list[int]], max_tokens: int) -> list[str]:
    """What the exact fp32 engine generates greedily for each prompt, as text."""
    from models import load_model
    from services.common.tokenizer import load_tokenizer
    from services.engine import GenerationParams, LLMEngine

    tok = load_tokenizer(ZOO)
    params = GenerationParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = LLMEngine(load_model(ZOO)).generate(prompts, params)
    return [tok.decode(s.output_ids, skip_special_tokens=True) for s in seqs]
