"""Soak: `splitstack serve` (embedded, and disaggregated on Ray) in a subprocess on
loopback, driven for a bounded time at a fixed concurrency with a mix of traffic, then
checked for what must hold after it:

- 0 unexpected errors: every request gets the answer its kind expects (200 with a finish
  reason; a bad request its 4xx naming the field; a client that hangs up mid-stream has
  its request aborted and sees nothing wrong before that);
- 0 leaked KV blocks once the traffic drained: the embedded engine's KV usage is 0, and
  each attention service's `Stats` has every block free;
- RSS outside the KV caches' memory maps at the end within 10% of the same after warm-up:
  the server process, and the server with every process under it (Ray's included). The
  KV caches are lazily backed maps whose resident part grows with the blocks first written,
  up to `--kv-cache-gib`, by design; the result reports both figures.

The mix (weights): streamed completions, whole completions with n = 2, chat (whole and
streamed), streams the client abandons after the first chunk, and bad requests (each
answered 4xx: a temperature out of range, an unknown model, invalid JSON, a prompt over
the context, too many stop strings, a body over the size cap).

    python -m bench.serving.soak [--minutes 10] [--concurrency 16] [--deployment embedded|ray|both]
                                 [--model models/zoo/smollm2-135m] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.common import MODEL, ServeProcess, memory


# ---- the traffic -------------------------------------------------------------------------
class Mix:
    """One request of a kind drawn by weight; `run` returns (kind, outcome) where outcome
    is "ok" or what was unexpected."""

    WEIGHTS = {"stream": 30, "n2": 15, "chat": 10, "chat_stream": 10, "disconnect": 15,
               "bad": 20}

    def __init__(self, base: str, model: str, headers: dict, max_model_len: int, seed: int):
        self.base, self.model, self.headers = base, model, headers
        self.max_model_len = max_model_len
        self.rng = random.Random(seed)
        self.kinds = list(self.WEIGHTS)
        self.weights = list(self.WEIGHTS.values())

    def prompt(self) -> str:
        words = ["the", "river", "a", "quiet", "city", "of", "numbers", "runs", "north",
                 "under", "light", "1,", "2,", "3,"]
        return " ".join(self.rng.choice(words) for _ in range(self.rng.randint(3, 60)))

    def bad_request(self) -> tuple[dict | bytes, int, str | None]:
        """(body, expected status, expected `param`)."""
        m, p = self.model, self.prompt()
        cases = [
            ({"model": m, "prompt": p, "temperature": 3.0}, 400, "temperature"),
            ({"model": "no-such-model", "prompt": p}, 404, "model"),
            (b'{"model": "' + m.encode() + b'", "prompt": ', 400, None),
            ({"model": m, "prompt": [1] * (self.max_model_len + 8)}, 400, "prompt"),
            ({"model": m, "prompt": p, "stop": ["x"] * 40}, 400, "stop"),
            ({"model": m, "prompt": p, "n": 99}, 400, "n"),
            (b'{"model": "' + m.encode() + b'", "prompt": "' + b"a" * (5 << 20) + b'"}',
             413, None),
        ]
        return self.rng.choice(cases)

    async def run(self, client: httpx.AsyncClient) -> tuple[str, str]:
        kind = self.rng.choices(self.kinds, self.weights)[0]
        try:
            return kind, await getattr(self, "_" + kind)(client)
        except httpx.HTTPError as exc:
            return kind, f"{kind}: {type(exc).__name__}: {exc}"

    def _completion(self, **extra) -> dict:
        return {"model": self.model, "prompt": self.prompt(),
                "max_tokens": self.rng.randint(4, 24), "temperature": 0.7,
                "seed": self.rng.randint(0, 1000), **extra}

    async def _stream_body(self, client, path: str, body: dict, abandon: bool = False) -> str:
        async with client.stream("POST", path, json=body, headers=self.headers) as r:
            if r.status_code != 200:
                return f"stream: {r.status_code} {(await r.aread())[:200]!r}"
            reasons, done = [], False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    return f"stream error: {event['error']}"
                if abandon:
                    return "ok"          # hang up: the server aborts the request
                reasons += [c["finish_reason"] for c in event["choices"] if c["finish_reason"]]
            n = body.get("n", 1)
            if not done or len(reasons) != n:
                return f"stream ended without [DONE] or {n} finish reasons: {reasons}"
            return "ok"

    async def _stream(self, client) -> str:
        return await self._stream_body(client, "/v1/completions",
                                       self._completion(stream=True))

    async def _disconnect(self, client) -> str:
        body = self._completion(stream=True, max_tokens=64, ignore_eos=True)
        return await self._stream_body(client, "/v1/completions", body, abandon=True)

    async def _n2(self, client) -> str:
        r = await client.post("/v1/completions", json=self._completion(n=2),
                              headers=self.headers)
        if r.status_code != 200:
            return f"n2: {r.status_code} {r.text[:200]}"
        choices = r.json()["choices"]
        ok = len(choices) == 2 and all(c["finish_reason"] in ("stop", "length")
                                       for c in choices)
        return "ok" if ok else f"n2: {r.text[:200]}"

    def _chat_body(self, **extra) -> dict:
        return {"model": self.model, "max_tokens": self.rng.randint(4, 24),
                "messages": [{"role": "user", "content": self.prompt()}], **extra}

    async def _chat(self, client) -> str:
        r = await client.post("/v1/chat/completions", json=self._chat_body(),
                              headers=self.headers)
        if r.status_code != 200:
            return f"chat: {r.status_code} {r.text[:200]}"
        return "ok" if r.json()["choices"][0]["finish_reason"] else f"chat: {r.text[:200]}"

    async def _chat_stream(self, client) -> str:
        return await self._stream_body(client, "/v1/chat/completions",
                                       self._chat_body(stream=True))

    async def _bad(self, client) -> str:
        body, status, param = self.bad_request()
        if isinstance(body, bytes):
            r = await client.post("/v1/completions", content=body,
                                  headers={**self.headers, "content-type": "application/json"})
        else:
            r = await client.post("/v1/completions", json=body, headers=self.headers)
        error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith(
            "application/json") else {}
        if r.status_code != status or not error.get("message") or (
                param is not None and error.get("param") != param):
            return f"bad: expected {status} ({param}), got {r.status_code} {r.text[:200]}"
        return "ok"


async def drive(base: str, model: str, headers: dict, seconds: float, concurrency: int,
                max_model_len: int, seed: int = 0) -> dict:
    """`concurrency` clients, each sending one request after another, for `seconds`."""
    counts, unexpected, latencies = Counter(), [], {}
    deadline = time.monotonic() + seconds

    async def client_loop(i: int):
        mix = Mix(base, model, headers, max_model_len, seed * 1000 + i)
        limits = httpx.Limits(max_connections=2, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
            while time.monotonic() < deadline:
                start = time.perf_counter()
                kind, outcome = await mix.run(client)
                latencies.setdefault(kind, []).append(time.perf_counter() - start)
                counts[kind] += 1
                if outcome != "ok":
                    unexpected.append(outcome)

    await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
    return {"requests": dict(counts), "unexpected": len(unexpected),
            "unexpected_samples": unexpected[:10],
            "p50_s": {k: round(statistics.median(v), 3) for k, v in latencies.items()}}


def metric(base: str, name: str) -> dict[str, float]:
    """Samples of one metric from /metrics: labels text -> value."""
    out = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            out[key[len(name):]] = float(value)
    return out


def kv_in_use(base: str, token: str | None) -> dict[str, float]:
    """What each engine holds once idle: each attention service's blocks in use (its
    Stats over gRPC, with the deployment's token), or the embedded engine's share of
    blocks in use (/metrics; 0 exactly when it holds none)."""
    services = [k.split('member="')[1].split('"')[0]
                for k in metric(base, "splitstack_attention_up")]
    if not services:
        return {"embedded (share)": metric(base, "splitstack_kv_cache_usage_ratio")[""]}
    import grpc

    from services.common.grpc_security import GrpcSecurity
    from services.common.pb import splitstack_pb2 as pb
    from services.common.pb import splitstack_pb2_grpc as pb_grpc

    security = GrpcSecurity(token=token)
    out = {}
    for address in services:
        with security.channel(address) as channel:
            try:
                st = pb_grpc.AttentionStub(channel).Stats(pb.Empty(), timeout=10)
            except grpc.RpcError as err:
                raise RuntimeError(f"{address}: {err.code().name}") from err
        out[f"{address} (blocks)"] = st.blocks_total - st.blocks_free
    return out


def soak(deployment: str, seconds: float, concurrency: int, model: Path, warmup_s: float,
         log_dir: Path) -> dict:
    token = secrets.token_urlsafe(24)
    api_key = secrets.token_urlsafe(24)
    flags = ["--model", str(model), "--log-level", "warning"]
    if deployment == "ray":
        flags += ["--disaggregated", "--threads", "1"]
    env = {"SPLITSTACK_GRPC_TOKEN": token, "SPLITSTACK_API_KEY": api_key}
    headers = {"Authorization": f"Bearer {api_key}"}
    log_path = log_dir / f"soak-{deployment}.log"
    started = time.perf_counter()
    with ServeProcess(flags, log_path, env) as server:
        startup = time.perf_counter() - started
        served = httpx.get(server.base + "/v1/models", headers=headers).json()["data"][0]
        name, max_model_len = served["id"], served["max_model_len"]
        run = lambda s: asyncio.run(drive(server.base, name, headers, s, concurrency,   # noqa: E731
                                          max_model_len))
        warm = run(warmup_s)
        rss_warm, heap_warm = memory(server.pid)
        main = run(seconds)
        time.sleep(1.0)      # aborts of abandoned streams land at the next step boundary
        rss_end, heap_end = memory(server.pid)
        deadline = time.time() + 30
        while True:
            blocks = kv_in_use(server.base, token)
            if not any(blocks.values()) or time.time() > deadline:
                break
            time.sleep(0.5)
        health = httpx.get(server.base + "/health").status_code
        logs = server.logs()
    leaked_secret = token in logs or api_key in logs
    result = {
        "deployment": deployment, "seconds": seconds, "warmup_s": warmup_s,
        "concurrency": concurrency, "startup_s": round(startup, 1),
        "requests": main["requests"], "total_requests": sum(main["requests"].values()),
        "unexpected_errors": main["unexpected"] + warm["unexpected"],
        "unexpected_samples": warm["unexpected_samples"] + main["unexpected_samples"],
        "p50_s": main["p50_s"], "kv_in_use_after": blocks,
        "rss_mb_after_warmup": [round(v) for v in rss_warm],
        "rss_mb_end": [round(v) for v in rss_end],
        # growth outside the KV caches' maps (those grow with the blocks first written, up
        # to --kv-cache-gib, by design): a leak shows here
        "rss_without_kv_mb_after_warmup": [round(v) for v in heap_warm],
        "rss_without_kv_mb_end": [round(v) for v in heap_end],
        "rss_growth": [round(e / w - 1, 4) for e, w in zip(heap_end, heap_warm)],
        "health_after": health, "secret_in_logs": leaked_secret,
    }
    result["passed"] = (result["unexpected_errors"] == 0 and not any(blocks.values())
                        and all(g <= 0.10 for g in result["rss_growth"]) and health == 200
                        and not leaked_secret)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--warmup-s", type=float, default=None,
                    help="traffic before the RSS baseline (default: 10%% of the run, ≤ 60 s)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--deployment", choices=("embedded", "ray", "both"), default="both")
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    seconds = args.minutes * 60
    warmup = args.warmup_s if args.warmup_s is not None else min(60.0, seconds / 10)
    log_dir = Path(tempfile.mkdtemp(prefix="soak-"))
    results = []
    for deployment in (("embedded", "ray") if args.deployment == "both"
                       else (args.deployment,)):
        r = soak(deployment, seconds, args.concurrency, args.model, warmup, log_dir)
        results.append(r)
        print(json.dumps(r, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
