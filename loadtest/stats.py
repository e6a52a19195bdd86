"""One sweep point's figures under `vllm bench serve`'s field names, so a result compares
with vLLM's line for line. Per metric (ttft, tpot, itl, e2el): `mean_*_ms`, `median_*_ms`,
`std_*_ms` and `p{50,90,95,99}_*_ms`. TPOT of a request is (E2EL − TTFT) / (output tokens
− 1), for requests with more than one output token; ITL pools every chunk gap of every
request. Throughputs divide by `duration`, the time from the first send to the last
request's end; the token totals count completed requests only.

Unlike vLLM, which has no time bound, the latency figures also count the requests
cancelled at the time bound, with their times censored at the cancel
(`RequestResult.censor`): dropping them would drop exactly the slowest requests. Failed
requests (an error answer or a broken stream) are counted apart (`failed`, `errors`):
the time to an error is not a latency. Goodput is vLLM's: the completed requests that
met every given SLO (`--goodput ttft:MS,tpot:MS,e2el:MS`), per second."""
from __future__ import annotations

import numpy as np

from loadtest.client import RequestResult

PERCENTILES = (50, 90, 95, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
MIN_REQUESTS_FOR_P99 = 100     # fewer, and p99 is (close to) the largest sample


def parse_goodput(items: list[str]) -> dict[str, float]:
    """vLLM's `--goodput` SLOs, `KEY:MS` with KEY in ttft, tpot, e2el, given as separate
    items or comma-separated; {metric: ms}."""
    slos: dict[str, float] = {}
    for item in (part for text in items for part in text.split(",") if part.strip()):
        key, sep, value = item.strip().partition(":")
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"goodput SLO {item!r}: expected KEY:MS with KEY one of "
                             f"ttft, tpot, e2el")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of ms") from None
        if not ms >= 0:
            raise ValueError(f"goodput SLO {item!r}: must be ≥ 0 ms")
        slos[key] = ms
    return slos


def tpot(r: RequestResult) -> float | None:
    """(E2EL − TTFT) / (tokens − 1); for a cancelled request its chunks so far count as
    the tokens, and its E2EL is the time until the cancel."""
    n = r.output_tokens if r.success else len(r.chunk_times)
    return (r.latency - r.ttft) / (n - 1) if n > 1 and r.status != "failed" else None


def is_good(r: RequestResult, slos: dict[str, float]) -> bool:
    """vLLM's goodput test: completed, and within every SLO (a one-token answer's TPOT
    is 0, as vLLM counts it)."""
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": tpot(r) or 0.0, "e2el": r.latency}
    return all(values[k] * 1000.0 <= ms for k, ms in slos.items())


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
    times = [t - t0 for r in results if r.status != "failed" for t in r.chunk_times]
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
                 slos: dict[str, float] | None = None, not_sent: int = 0) -> dict:
    """The figures of one point from every request sent (completed, failed or cancelled);
    `not_sent`: requests the time bound kept from going out."""
    ok = [r for r in results if r.success]
    timed = [r for r in results if r.status != "failed"]      # completed and censored
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)

    def per_s(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": sum(r.status == "failed" for r in results),
        "cancelled": sum(r.cancelled for r in results),
        "not_sent": not_sent,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "request_goodput": per_s(sum(is_good(r, slos) for r in ok)) if slos else None,
        "goodput_slos_ms": slos or None,
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "max_output_tokens_per_s": peak_output_per_s(results, t0),
        "max_concurrent_requests": peak_concurrency(results),
    }
    out.update(summarize([r.ttft for r in timed], "ttft"))
    out.update(summarize([t for r in timed if (t := tpot(r)) is not None], "tpot"))
    out.update(summarize([x for r in timed for x in r.itl], "itl"))
    out.update(summarize([r.latency for r in timed], "e2el"))
    # per request, as vLLM saves them (seconds); e2els, kinds and statuses are ours
    out["input_lens"] = [r.prompt_len for r in results]
    out["output_lens"] = [r.output_tokens if r.status != "failed" else 0 for r in results]
    out["ttfts"] = [r.ttft for r in results]
    out["itls"] = [r.itl for r in results]
    out["e2els"] = [r.latency for r in results]
    out["kinds"] = [r.kind for r in results]
    out["statuses"] = [r.status for r in results]
    out["errors"] = [r.error for r in results]
    return out


def request_records(results: list[RequestResult], t0: float,
                    slos: dict[str, float] | None = None) -> list[dict]:
    """One record per request sent, in sending order (`requests.jsonl`): seconds since
    the point's start for `send_s`, seconds since the request's send for the rest."""
    return [{"index": i, "kind": r.kind, "status": r.status, "send_s": r.start - t0,
             "ttft_s": r.ttft if r.chunk_times or r.cancelled else None,
             "e2el_s": r.latency, "chunk_s": [t - r.start for t in r.chunk_times],
             "prompt_len": r.prompt_len, "output_len": r.output_tokens,
             "good": is_good(r, slos) if slos else None, "error": r.error}
            for i, r in enumerate(results)]
