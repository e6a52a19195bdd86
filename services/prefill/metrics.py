"""Prefill-service metrics (prefix `splitstack_`, seconds)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.seconds = Histogram("splitstack_prefill_seconds",
                                 "Prefill-service time per prompt", registry=r,
                                 buckets=PREFILL_BUCKETS)
        self.filled = Counter("splitstack_ridgefill_filled_rows_total",
                              "Prompt rows whose upper layers were filled (skipped)", registry=r)
        self.exact = Counter("splitstack_ridgefill_exact_rows_total",
                             "Prompt rows run through every layer by the prefill service",
                             registry=r)

    def observe_prefill(self, rows: int, filled: int, seconds: float) -> None:
        self.seconds.observe(seconds)
        self.filled.inc(filled)
        self.exact.inc(rows - filled)
