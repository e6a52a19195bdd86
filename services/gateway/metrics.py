"""Prometheus metrics exported by the gateway (prefix `splitstack_`, seconds), in vLLM's
shapes: per-request stage histograms, outcome counters, token counters, HTTP responses by
status code, and the service-level objectives the alert rules hold each deployment to.

A request's stages (vLLM's): queued (`add_request` until the engine first schedules it),
prefilled (from then to its first token; in the Ray deployment with prefill replicas, from
the start of the replica's prefill), decoded (first token to last). Every series and its
meaning: docs/metrics.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.utils import floatToGoString

# One bucket set per histogram, as vLLM has: a GPU's first token and token gaps take
# milliseconds, a whole request up to hours. Each objective (`Objectives`) is added as a
# boundary, so the share of requests within it is read exactly from its bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
                640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
               0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                   30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3600.0, 7680.0)
# tokens in a prompt or an answer: 1, 2, 5, 10, ... 1M (vLLM's 1-2-5 series)
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5)) + (1_000_000,)
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class Objectives:
    """The service-level objectives, exported on /metrics so that the alerts and dashboards
    of each deployment read its own (deploy/prometheus/rules/): `ttft_s` and `itl_s` as
    `splitstack_slo_objective_seconds{slo, le}` (`le` spelt as the histogram's bucket
    label, so a rule selects the bucket with `and ignoring (slo)`), the share of requests
    (tokens, for ITL) that must meet them and `availability` (the share of API requests
    answered without a 5xx) as `splitstack_slo_target_ratio{slo}`."""
    ttft_s: float = 2.0
    ttft_target: float = 0.95
    itl_s: float = 0.2
    itl_target: float = 0.95
    availability: float = 0.999

    def __post_init__(self):
        for name in ("ttft_s", "itl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("ttft_target", "itl_target", "availability"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)!r}")


def objectives_for(ttft_s: float | None, itl_s: float | None) -> Objectives:
    """The objectives with the TTFT and ITL bounds given (the autoscaler's p95 targets,
    `--slo-ttft-ms` and `--slo-itl-ms`: a p95 target is the bound 95% must meet), the
    defaults for those not given."""
    given = {name: value for name, value in (("ttft_s", ttft_s), ("itl_s", itl_s))
             if value is not None}
    return Objectives(**given)


def with_boundary(buckets: tuple[float, ...], bound: float) -> tuple[float, ...]:
    return tuple(sorted(set(buckets) | {float(bound)}))


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None,
                 objectives: Objectives = Objectives()):
        self.registry = registry or CollectorRegistry()
        self.objectives = objectives
        r = self.registry

        def seconds(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"splitstack_{name}_seconds", doc, registry=r, buckets=buckets)

        self.ttft = seconds("time_to_first_token", "Time from request arrival to its first "
                                                   "token",
                            with_boundary(TTFT_BUCKETS, objectives.ttft_s))
        self.itl = seconds("inter_token_latency", "Time between consecutive tokens of a "
                                                  "request",
                           with_boundary(ITL_BUCKETS, objectives.itl_s))
        self.e2e = seconds("e2e_request_latency", "Time from request arrival to its last token",
                           REQUEST_BUCKETS)
        self.queue_time = seconds("request_queue_time", "Time a request waited in the "
                                                        "engine's queue before its first "
                                                        "scheduling", TTFT_BUCKETS)
        self.prefill_time = seconds("request_prefill_time", "Time from a request's first "
                                                            "scheduling to its first token",
                                    TTFT_BUCKETS)
        self.decode_time = seconds("request_decode_time", "Time from a request's first token "
                                                          "to its last", REQUEST_BUCKETS)
        self.tpot = seconds("request_time_per_output_token", "A finished request's mean time "
                            "per output token after its first (decode time / (tokens - 1))",
                            ITL_BUCKETS)
        self.prompt_lengths = Histogram("splitstack_request_prompt_tokens", "Prompt tokens "
                                        "of each finished request", registry=r,
                                        buckets=TOKEN_BUCKETS)
        self.generation_lengths = Histogram("splitstack_request_generation_tokens", "Tokens "
                                            "each finished request generated", registry=r,
                                            buckets=TOKEN_BUCKETS)
        self.info = Gauge("splitstack_model_info", "The model the gateway serves and the "
                          "splitstack version (the value is 1)",
                          ["model", "version", "max_model_len"], registry=r)
        ProcessCollector(registry=r)        # process_cpu_seconds_total, ..._memory_bytes, ...
        objective = Gauge("splitstack_slo_objective_seconds", "Latency objective: the bucket "
                          "boundary (le) a request or token must be within", ["slo", "le"],
                          registry=r)
        for slo, bound in (("time_to_first_token", objectives.ttft_s),
                           ("inter_token_latency", objectives.itl_s)):
            objective.labels(slo, floatToGoString(bound)).set(bound)
        target = Gauge("splitstack_slo_target_ratio", "Share of requests (tokens, for "
                       "inter_token_latency) that must meet each objective", ["slo"],
                       registry=r)
        for slo, share in (("time_to_first_token", objectives.ttft_target),
                           ("inter_token_latency", objectives.itl_target),
                           ("availability", objectives.availability)):
            target.labels(slo).set(share)
        self.http_requests = Counter("splitstack_http_requests", "HTTP responses by route "
                                     "and status code, refusals included", ["route", "code"],
                                     registry=r)
        self.requests = Counter("splitstack_requests_total", "Finished requests", ["status"],
                                registry=r)
        self.finished = Counter("splitstack_requests_finished_total", "Finished requests by "
                                "finish reason (stop, length, abort, error)", ["reason"],
                                registry=r)
        for reason in FINISH_REASONS:       # every reason exported from the start, at 0
            self.finished.labels(reason)
        self.prompt_tokens = Counter("splitstack_prompt_tokens_total", "Prompt tokens",
                                     registry=r)
        self.generation_tokens = Counter("splitstack_generation_tokens_total",
                                         "Generated tokens", registry=r)
        self.kv_usage = Gauge("splitstack_kv_cache_usage_ratio",
                              "Fraction of KV blocks in use (0-1)", registry=r)
        self.running = Gauge("splitstack_requests_running", "Requests the engines schedule "
                             "now (prefilling or decoding)", registry=r)
        self.waiting = Gauge("splitstack_requests_waiting", "Requests in the engines' "
                             "queues, not yet scheduled", registry=r)

    def finish(self, outcome: str, prompt_tokens: int, generated: int) -> None:
        """Count one request under its outcome (a finish reason), with its lengths."""
        self.requests.labels(outcome).inc()
        self.finished.labels(outcome).inc()
        self.prompt_lengths.observe(prompt_tokens)
        self.generation_lengths.observe(generated)

    def describe(self, model: str, max_model_len: int) -> None:
        """`splitstack_model_info`: the served model and this build."""
        self.info.labels(model, version(), str(max_model_len)).set(1)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("splitstack")
    except PackageNotFoundError:           # run from a checkout that was never installed
        return "unknown"


def export_pool_limits(registry: CollectorRegistry, limits: dict[str, int]) -> None:
    """`splitstack_pool_replicas_max{pool}`: the most members each resizable pool may have
    (the autoscaler's MAX for a pool it bounds, else the deployment's `--max-replicas`)."""
    gauge = Gauge("splitstack_pool_replicas_max", "The most members each resizable pool may "
                  "have", ["pool"], registry=registry)
    for pool, most in limits.items():
        gauge.labels(pool).set(most)
