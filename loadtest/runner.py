"""The load: a closed loop (C clients, each sending its next request when the last one
ends) or an open loop (arrivals at R requests/s, Poisson or gamma with `burstiness`,
sent whether or not earlier ones ended, at most `max_concurrency` in flight when set),
one sweep point per concurrency or rate. Every point is bounded twice: it sends at most
`num_requests` requests, and at `max_seconds` it stops sending and cancels what is still
in flight (the server sees the client hang up and aborts them; they count as
`cancelled`, their times censored at the cancel). Before a point, `num_warmups`
requests go out unmeasured, and the server's counters are read before and after it."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np
from tqdm import tqdm

from loadtest.client import (LoadTestError, RequestResult, ServerTokenCounter, headers_for,
                             send, server_info)
from loadtest.datasets import DatasetConfig
from loadtest.scenarios import RequestSpec, ScenarioConfig, estimate_tokens
from loadtest.server_metrics import increase, scrape
from loadtest.stats import MIN_REQUESTS_FOR_P99, point_result, request_records

# splitstack serve's --max-connections-per-client default: past it, a connection is
# answered 429, and the load would measure the refusals
SERVER_CONNECTIONS_PER_CLIENT = 64

Workload = ScenarioConfig | DatasetConfig


@dataclass(frozen=True)
class RunConfig:
    url: str = "http://127.0.0.1:8000"
    model: str | None = None                  # default: the server's first model
    api_key: str | None = None
    concurrency: tuple[int, ...] = ()         # closed loop, one point each
    rates: tuple[float, ...] = ()             # open loop, requests/s, one point each
    burstiness: float = 1.0                   # open loop: gamma shape; 1.0 is Poisson
    max_concurrency: int | None = None        # open loop: requests in flight at most
    max_seconds: float = 300.0                # per sweep point
    num_warmups: int = 0                      # per sweep point, before it, unmeasured
    goodput: dict = field(default_factory=dict, hash=False)   # {ttft|tpot|e2el: ms}
    request_timeout: float = 600.0
    progress: bool = True

    def __post_init__(self):
        if bool(self.concurrency) == bool(self.rates):
            raise ValueError("give either concurrency levels or request rates")
        if any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency levels must be ≥ 1, got {self.concurrency}")
        if any(not r > 0 for r in self.rates):
            raise ValueError(f"request rates must be > 0, got {self.rates}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and (self.concurrency or self.max_concurrency < 1):
            raise ValueError("max_concurrency caps an open loop (rates) and must be ≥ 1, got "
                             f"{self.max_concurrency}")
        if not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be > 0, got {self.max_seconds}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be ≥ 0, got {self.num_warmups}")
        object.__setattr__(self, "url", self.url.rstrip("/"))

    def points(self) -> list[tuple[int | None, float | None]]:
        return ([(c, None) for c in self.concurrency] if self.concurrency
                else [(None, r) for r in self.rates])


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times (seconds from the point's start) of `n` requests: the first at 0, then
    vLLM's gaps, gamma-distributed with shape `burstiness` and scale 1 / (rate ·
    burstiness): mean 1 / rate, coefficient of variation 1 / √burstiness (1.0: Poisson;
    below 1 burstier, above 1 steadier)."""
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness),
                                             size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])


def _client(run: RunConfig, in_flight: int | None) -> httpx.AsyncClient:
    """A pool that keeps a connection alive per request in flight (`None`: unbounded)."""
    return httpx.AsyncClient(base_url=run.url, timeout=httpx.Timeout(run.request_timeout,
                                                                     connect=10.0),
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=in_flight))


async def drive(run: RunConfig, specs: list[RequestSpec], model: str, concurrency: int | None,
                rate: float | None, seed: int, label: str):
    """Runs one point; returns (results in sending order, duration, t0)."""
    headers = headers_for(run.api_key)
    results: list[RequestResult] = []
    bar = tqdm(total=len(specs), desc=label, unit="req", file=sys.stderr,
               disable=not run.progress, dynamic_ncols=True)
    cap = concurrency or run.max_concurrency
    gate = asyncio.Semaphore(run.max_concurrency) if run.max_concurrency else \
        contextlib.nullcontext()
    async with _client(run, cap) as client:
        t0 = time.perf_counter()
        deadline = t0 + run.max_seconds

        async def one(spec: RequestSpec):
            out = RequestResult(spec.kind)
            async with gate:
                results.append(out)     # `send` stamps out.start before its first await
                try:
                    await send(client, spec, model, headers, out)
                except asyncio.CancelledError:
                    out.censor(time.perf_counter())
                    raise
            bar.update()

        if concurrency is not None:
            queue = iter(specs)

            async def worker():
                for spec in queue:
                    if time.perf_counter() >= deadline:
                        return
                    await one(spec)

            tasks = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(specs)))]
        else:
            tasks = []
            for spec, at in zip(specs, t0 + arrival_times(len(specs), rate, run.burstiness,
                                                           seed)):
                if at >= deadline:
                    break
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                tasks.append(asyncio.create_task(one(spec)))
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        duration = time.perf_counter() - t0
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    bar.close()
    return results, duration, t0


async def warm_up(run: RunConfig, specs: list[RequestSpec], model: str,
                  width: int) -> list[RequestResult]:
    """Sends `specs` unmeasured, `width` at a time (vLLM's `--num-warmups`)."""
    headers, results = headers_for(run.api_key), []
    async with _client(run, width) as client:
        queue = iter(specs)

        async def worker():
            for spec in queue:
                results.append(await send(client, spec, model, headers))

        await asyncio.gather(*(worker() for _ in range(min(width, len(specs)))))
    return results


def check_first(run: RunConfig, spec: RequestSpec, model: str) -> None:
    """vLLM's test run: one request before the load, so that a bad model name, body or
    key stops the run with the server's own message."""
    async def go():
        async with _client(run, 1) as client:
            return await send(client, dataclasses.replace(spec, body={**spec.body,
                                                                      "max_tokens": 2}),
                              model, headers_for(run.api_key))
    result = asyncio.run(go())
    if not result.success:
        raise LoadTestError(f"the first request failed: {result.error}")


def run_point(run: RunConfig, workload: Workload, count, model: str, i: int,
              concurrency: int | None, rate: float | None, log) -> dict:
    """One sweep point: warm-ups, the counters, the load, the counters again."""
    label = f"concurrency {concurrency}" if concurrency else f"rate {rate:g}/s"
    cap = concurrency or run.max_concurrency
    if cap and cap > SERVER_CONNECTIONS_PER_CLIENT:
        log(f"warning: {label}: {cap} requests in flight from one client exceed splitstack's "
            f"default cap of {SERVER_CONNECTIONS_PER_CLIENT} connections per client address; "
            "serve with --max-connections-per-client or expect HTTP 429s")
    if run.num_warmups:
        warm = dataclasses.replace(workload, num_requests=run.num_warmups)
        done = asyncio.run(warm_up(run, warm.requests(count, point=-2 - i), model,
                                   cap or run.num_warmups))
        if bad := [r.error for r in done if not r.success]:
            log(f"warning: {label}: {len(bad)} of {len(done)} warm-ups failed: {bad[0]}")
    specs = workload.requests(count, point=i, log=log)
    headers = headers_for(run.api_key)
    before, wall0 = scrape(run.url, headers), time.time()
    results, duration, t0 = asyncio.run(
        drive(run, specs, model, concurrency, rate, workload.seed + i, label))
    counters = increase(before, scrape(run.url, headers))
    point = {"max_concurrency": cap, "request_rate": rate if rate else "inf",
             "burstiness": run.burstiness if rate else 1.0, "num_prompts": len(specs),
             "num_warmups": run.num_warmups, "start_time": wall0, "end_time": wall0 + duration,
             **point_result(results, duration, t0, run.goodput, len(specs) - len(results)),
             "server_counters": counters,
             "requests": request_records(results, t0, run.goodput)}
    if not cap and point["max_concurrent_requests"] > SERVER_CONNECTIONS_PER_CLIENT:
        log(f"warning: {label}: up to {point['max_concurrent_requests']} requests were in "
            f"flight, over splitstack's default cap of {SERVER_CONNECTIONS_PER_CLIENT} "
            "connections per client address; --max-concurrency bounds them")
    log(summary(label, point))
    return point


def run_sweep(run: RunConfig, workload: Workload,
              log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict:
    """The whole sweep: a dict with the run's settings and one entry per point in
    "points" (see `loadtest.stats`), each with its wall-clock `start_time` / `end_time`
    (Unix seconds, for Prometheus) and its per-request records under "requests"."""
    headers = headers_for(run.api_key)
    info = server_info(run.url, headers)
    model = run.model or info["id"]
    if workload.num_requests < MIN_REQUESTS_FOR_P99:
        log(f"warning: {workload.num_requests} requests per point: p99 needs at least "
            f"{MIN_REQUESTS_FOR_P99}; with fewer it is (close to) the slowest request")
    counter = ServerTokenCounter.probe(run.url, model, headers)
    if counter is None:
        log("the server has no /tokenize: prompt lengths are estimated")
    workload = dataclasses.replace(workload, max_model_len=info["max_model_len"])
    count = counter or estimate_tokens
    check_first(run, dataclasses.replace(workload, num_requests=1).requests(count, point=-1)[0],
                model)
    points = [run_point(run, workload, count, model, i, concurrency, rate, log)
              for i, (concurrency, rate) in enumerate(run.points())]
    if counter is not None:
        counter.client.close()
    is_dataset = isinstance(workload, DatasetConfig)
    return {"date": time.strftime("%Y%m%d-%H%M%S", time.gmtime()), "backend": "openai",
            "base_url": run.url, "model_id": model, "max_model_len": info["max_model_len"],
            "dataset_name": workload.name if is_dataset else "builtin",
            "dataset_path": str(workload.path) if is_dataset and workload.path else None,
            "scenario": None if is_dataset else workload.name, "workload": workload.label,
            "seed": workload.seed,
            "reuse_ratio": workload.reuse_ratio if not is_dataset and workload.name in
            ("shared-prefix", "mix") else None,
            "extra_body": workload.extra_body, "max_seconds": run.max_seconds,
            "num_warmups": run.num_warmups, "goodput": run.goodput or None,
            "mode": "concurrency" if run.concurrency else "rate", "points": points}


def summary(label: str, p: dict) -> str:
    """vLLM's result block, for one point."""
    rows = [("Successful requests", p["completed"]), ("Failed requests", p["failed"]),
            ("Cancelled at the time bound", p["cancelled"]),
            ("Not sent (time bound)", p["not_sent"]),
            ("Benchmark duration (s)", p["duration"]),
            ("Total input tokens", p["total_input_tokens"]),
            ("Total generated tokens", p["total_output_tokens"]),
            ("Request throughput (req/s)", p["request_throughput"])]
    if p["request_goodput"] is not None:
        rows.append(("Request goodput (req/s)", p["request_goodput"]))
    rows += [("Output token throughput (tok/s)", p["output_throughput"]),
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
