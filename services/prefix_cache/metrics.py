"""Prometheus metrics of the prefix cache (`splitstack_prefix_cache_*`: tokens, bytes, seconds)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REPLAY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class PrefixCacheMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        p = "splitstack_prefix_cache_"
        self.query_tokens = Counter(p + "query_tokens_total", "Prompt tokens looked up",
                                    registry=r)
        self.hit_tokens = Counter(p + "hit_tokens_total",
                                  "Looked-up tokens served from the cache, by the tier "
                                  "their block came from", ["tier"], registry=r)
        self.inserted_tokens = Counter(p + "inserted_tokens_total",
                                       "Tokens newly stored, by tier", ["tier"], registry=r)
        self.skipped_tokens = Counter(p + "skipped_tokens_total",
                                      "Tokens not stored in memory: no room beside pinned "
                                      "blocks", registry=r)
        self.evictions = Counter(p + "evictions_total", "Blocks evicted from memory",
                                 registry=r)
        self.errors = Counter(p + "errors_total",
                              "Tier failures degraded to a miss (kind: unavailable, "
                              "timeout, corrupt)", ["tier", "kind"], registry=r)
        self.memory_bytes = Gauge(p + "memory_bytes", "Payload bytes in the memory tier",
                                  registry=r)
        self.memory_capacity_bytes = Gauge(p + "memory_capacity_bytes",
                                           "Capacity of the memory tier", registry=r)
        self.device_bytes = Gauge(p + "device_bytes", "Bytes of the device tier's slots "
                                  "holding a block", registry=r)
        self.replay_seconds = Histogram(p + "replay_seconds",
                                        "Tail replay of the linear-attention states of a hit",
                                        registry=r, buckets=REPLAY_BUCKETS)
        self.transfer_seconds = Histogram(p + "transfer_seconds",
                                          "Host-to-device transfer of a hit's FA KV",
                                          registry=r, buckets=REPLAY_BUCKETS)
