"""Prometheus metrics exported by the gateway (prefix `splitstack_`, seconds)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("splitstack_time_to_first_token_seconds",
                              "Time from request arrival to its first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("splitstack_inter_token_latency_seconds",
                             "Time between consecutive tokens of a request", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("splitstack_e2e_request_latency_seconds",
                             "Time from request arrival to its last token", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.requests = Counter("splitstack_requests_total", "Finished requests", ["status"],
                                registry=r)
        self.prompt_tokens = Counter("splitstack_prompt_tokens_total", "Prompt tokens",
                                     registry=r)
        self.generation_tokens = Counter("splitstack_generation_tokens_total",
                                         "Generated tokens", registry=r)
        self.kv_usage = Gauge("splitstack_kv_cache_usage_ratio",
                              "Fraction of KV blocks in use (0-1)", registry=r)
        self.running = Gauge("splitstack_requests_running", "Requests in the engine",
                             registry=r)
