"""The load: a closed loop (C clients, each sending its next request when the last one
ends) or an open loop (Poisson arrivals at R requests/s, sent whether or not earlier ones
ended), one sweep point per concurrency or rate. Every point is bounded twice: it sends
at most `num_requests` requests, and at `max_seconds` it stops sending and cancels what is
still in flight (the server sees the client hang up and aborts them; they count as
`cancelled`, not `failed`)."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from loadtest.client import (LoadTestError, RequestResult, ServerTokenCounter, headers_for,
                             send, server_info)
from loadtest.scenarios import RequestSpec, ScenarioConfig, build_requests, estimate_tokens
from loadtest.stats import point_result


@dataclass(frozen=True)
class RunConfig:
    url: str = "http://127.0.0.1:8000"
    model: str | None = None                  # default: the server's first model
    api_key: str | None = None
    concurrency: tuple[int, ...] = ()         # closed loop, one point each
    rates: tuple[float, ...] = ()             # open loop (Poisson), requests/s, one point each
    max_seconds: float = 300.0                # per sweep point
    request_timeout: float = 600.0
    progress: bool = True

    def __post_init__(self):
        if bool(self.concurrency) == bool(self.rates):
            raise ValueError("give either concurrency levels or request rates")
        if any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency levels must be ≥ 1, got {self.concurrency}")
        if any(not r > 0 for r in self.rates):
            raise ValueError(f"request rates must be > 0, got {self.rates}")
        if not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be > 0, got {self.max_seconds}")
        object.__setattr__(self, "url", self.url.rstrip("/"))

    def points(self) -> list[tuple[int | None, float | None]]:
        return ([(c, None) for c in self.concurrency] if self.concurrency
                else [(None, r) for r in self.rates])


def _client(run: RunConfig) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=run.url, timeout=httpx.Timeout(run.request_timeout,
                                                                     connect=10.0),
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=64))


async def drive(run: RunConfig, specs: list[RequestSpec], model: str, concurrency: int | None,
                rate: float | None, seed: int, label: str):
    """Runs one point; returns (results, duration, t0, cancelled)."""
    headers = headers_for(run.api_key)
    results: list[RequestResult] = []
    bar = tqdm(total=len(specs), desc=label, unit="req", file=sys.stderr,
               disable=not run.progress, dynamic_ncols=True)
    started = 0
    async with _client(run) as client:
        t0 = time.perf_counter()
        deadline = t0 + run.max_seconds

        async def one(spec: RequestSpec):
            results.append(await send(client, spec, model, headers))
            bar.update()

        if concurrency is not None:
            queue = iter(specs)

            async def worker():
                nonlocal started
                for spec in queue:
                    if time.perf_counter() >= deadline:
                        return
                    started += 1
                    await one(spec)

            tasks = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(specs)))]
        else:
            tasks, rng, at = [], random.Random(seed), t0
            for i, spec in enumerate(specs):
                if i:
                    at += rng.expovariate(rate)
                if at >= deadline:
                    break
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                started += 1
                tasks.append(asyncio.create_task(one(spec)))
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        duration = time.perf_counter() - t0
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    bar.close()
    return results, duration, t0, started - len(results)


def check_first(run: RunConfig, spec: RequestSpec, model: str) -> None:
    """vLLM's test run: one request before the load, so that a bad model name, body or
    key stops the run with the server's own message."""
    async def go():
        async with _client(run) as client:
            return await send(client, dataclasses.replace(spec, body={**spec.body,
                                                                      "max_tokens": 2}),
                              model, headers_for(run.api_key))
    result = asyncio.run(go())
    if not result.success:
        raise LoadTestError(f"the first request failed: {result.error}")


def run_sweep(run: RunConfig, scenario: ScenarioConfig,
              log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict:
    """The whole sweep: a dict with the run's settings and one entry per point in
    "points" (see `loadtest.stats`), each with its wall-clock `start_time` / `end_time`
    (Unix seconds, for Prometheus)."""
    headers = headers_for(run.api_key)
    info = server_info(run.url, headers)
    model = run.model or info["id"]
    counter = ServerTokenCounter.probe(run.url, model, headers)
    if counter is None:
        log("the server has no /tokenize: prompt lengths are estimated")
    scenario = dataclasses.replace(scenario, max_model_len=info["max_model_len"])
    count = counter or estimate_tokens
    check_first(run, build_requests(dataclasses.replace(scenario, num_requests=1), count,
                                    point=-1)[0], model)
    points = []
    for i, (concurrency, rate) in enumerate(run.points()):
        specs = build_requests(scenario, count, point=i)
        label = f"concurrency {concurrency}" if concurrency else f"rate {rate:g}/s"
        wall0 = time.time()
        results, duration, t0, cancelled = asyncio.run(
            drive(run, specs, model, concurrency, rate, scenario.seed + i, label))
        point = {"max_concurrency": concurrency, "request_rate": rate if rate else "inf",
                 "burstiness": 1.0, "num_prompts": len(specs), "start_time": wall0,
                 "end_time": wall0 + duration, **point_result(results, duration, t0, cancelled)}
        points.append(point)
        log(summary(label, point))
    if counter is not None:
        counter.client.close()
    return {"date": time.strftime("%Y%m%d-%H%M%S", time.gmtime()), "backend": "openai",
            "base_url": run.url, "model_id": model, "max_model_len": info["max_model_len"],
            "scenario": scenario.name, "seed": scenario.seed,
            "reuse_ratio": scenario.reuse_ratio if scenario.name in ("shared-prefix", "mix")
            else None,
            "extra_body": scenario.extra_body, "max_seconds": run.max_seconds,
            "mode": "concurrency" if run.concurrency else "rate", "points": points}


def summary(label: str, p: dict) -> str:
    """vLLM's result block, for one point."""
    rows = [("Successful requests", p["completed"]), ("Failed requests", p["failed"]),
            ("Cancelled at the time bound", p["cancelled"]),
            ("Benchmark duration (s)", p["duration"]),
            ("Total input tokens", p["total_input_tokens"]),
            ("Total generated tokens", p["total_output_tokens"]),
            ("Request throughput (req/s)", p["request_throughput"]),
            ("Output token throughput (tok/s)", p["output_throughput"]),
            ("Total token throughput (tok/s)", p["total_token_throughput"])]
    for m, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        rows += [(f"{s.capitalize()} {name} (ms)", p[f"{k}_{m}_ms"])
                 for s, k in (("mean", "mean"), ("median", "median"), ("P99", "p99"))]
    lines = [f"{' ' + label + ' ':=^50}"]
    lines += [f"{k + ':':<40}{v:<10.2f}" if isinstance(v, float) else f"{k + ':':<40}{v:<10}"
              for k, v in rows]
    errors = sorted({e for e in p["errors"] if e})
    lines += [f"error: {e}" for e in errors[:5]]
    return "\n".join(lines + ["=" * 50])
