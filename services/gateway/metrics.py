"""Prometheus metrics exported by the gateway (prefix `splitstack_`, seconds), in vLLM's
shapes: per-request stage histograms, outcome counters, token counters.

A request's stages (vLLM's): queued (`add_request` until the engine first schedules it),
prefilled (from then to its first token; in the Ray deployment with prefill replicas, from
the start of the replica's prefill), decoded (first token to last). Every series and its
meaning: docs/metrics.md.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
FINISH_REASONS = ("stop", "length", "abort", "error")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry

        def seconds(name: str, doc: str) -> Histogram:
            return Histogram(f"splitstack_{name}_seconds", doc, registry=r,
                             buckets=LATENCY_BUCKETS)

        self.ttft = seconds("time_to_first_token", "Time from request arrival to its first "
                                                   "token")
        self.itl = seconds("inter_token_latency", "Time between consecutive tokens of a "
                                                  "request")
        self.e2e = seconds("e2e_request_latency", "Time from request arrival to its last token")
        self.queue_time = seconds("request_queue_time", "Time a request waited in the "
                                                        "engine's queue before its first "
                                                        "scheduling")
        self.prefill_time = seconds("request_prefill_time", "Time from a request's first "
                                                            "scheduling to its first token")
        self.decode_time = seconds("request_decode_time", "Time from a request's first token "
                                                          "to its last")
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
        self.running = Gauge("splitstack_requests_running", "Requests in the engine",
                             registry=r)
        self.waiting = Gauge("splitstack_requests_waiting", "Requests in the engines' "
                             "queues, not yet scheduled", registry=r)

    def finish(self, outcome: str) -> None:
        """Count one request under its outcome (a finish reason)."""
        self.requests.labels(outcome).inc()
        self.finished.labels(outcome).inc()
