"""One sweep point's figures under `vllm bench serve`'s field names, so a result compares
with vLLM's line for line. Per metric (ttft, tpot, itl, e2el): `mean_*_ms`, `median_*_ms`,
`std_*_ms` and `p{50,90,95,99}_*_ms`. TPOT of a request is (E2EL − TTFT) / (output tokens
− 1), for requests with more than one output token; ITL pools every chunk gap of every
request. Throughputs divide by `duration`, the time from the first send to the last
request's end; the token totals count completed requests only."""
from __future__ import annotations

import numpy as np

from loadtest.client import RequestResult

PERCENTILES = (50, 90, 95, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")


def summarize(values_s: list[float], name: str) -> dict:
    """mean / median / std / pXX of `values_s` (seconds) in ms under vLLM's names; 0.0
    when empty, as vLLM writes them."""
    a = np.asarray(values_s, dtype=float) * 1000.0
    out = {f"mean_{name}_ms": float(a.mean()) if a.size else 0.0,
           f"median_{name}_ms": float(np.median(a)) if a.size else 0.0,
           f"std_{name}_ms": float(a.std()) if a.size else 0.0}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(a, p)) if a.size else 0.0
    return out


def peak_output_per_s(results: list[RequestResult], t0: float) -> float:
    """The most output chunks that arrived in one whole second of the run."""
    times = [t - t0 for r in results if r.success for t in r.chunk_times]
    if not times:
        return 0.0
    return float(np.bincount(np.floor(times).astype(int)).max())


def peak_concurrency(results: list[RequestResult]) -> int:
    """The most requests in flight at once (each from its send to its end)."""
    events = sorted([(r.start, 1) for r in results]
                    + [(r.start + r.latency, -1) for r in results if r.latency])
    now = best = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def point_result(results: list[RequestResult], duration: float, t0: float,
                 cancelled: int) -> dict:
    ok = [r for r in results if r.success]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    def per_s(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "cancelled": cancelled,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "max_output_tokens_per_s": peak_output_per_s(results, t0),
        "max_concurrent_requests": peak_concurrency(results),
    }
    out.update(summarize([r.ttft for r in ok], "ttft"))
    out.update(summarize(tpots, "tpot"))
    out.update(summarize([x for r in ok for x in r.itl], "itl"))
    out.update(summarize([r.latency for r in ok], "e2el"))
    # per request, as vLLM saves them (seconds); e2els and kinds are ours
    out["input_lens"] = [r.prompt_len for r in results]
    out["output_lens"] = [r.output_tokens if r.success else 0 for r in results]
    out["ttfts"] = [r.ttft for r in results]
    out["itls"] = [r.itl for r in results]
    out["e2els"] = [r.latency for r in results]
    out["kinds"] = [r.kind for r in results]
    out["errors"] = [r.error for r in results]
    return out
