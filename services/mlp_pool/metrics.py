"""MLP pool metrics (prefix `splitstack_pool_`, seconds): stage latency and batch size."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

STAGE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
CALL_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32)


class PoolMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.stage_seconds = Histogram("splitstack_pool_stage_seconds",
                                       "Compute time of one batched pool forward (kind: stage, "
                                       "final or score)", ["kind"], registry=r,
                                       buckets=STAGE_BUCKETS)
        self.batch_rows = Histogram("splitstack_pool_batch_rows",
                                    "Rows in one batched pool forward", registry=r,
                                    buckets=ROW_BUCKETS)
        self.batch_calls = Histogram("splitstack_pool_batch_calls",
                                     "Calls (from any attention services) merged into one "
                                     "forward", registry=r, buckets=CALL_BUCKETS)
        self.failures = Counter("splitstack_pool_failed_forwards_total",
                                "Batched forwards that raised (every caller of the batch "
                                "retries elsewhere)", registry=r)

    def observe(self, kind: str, seconds: float, rows: int, calls: int) -> None:
        """One forward: `kind` stage, final or score, its rows, and the calls merged."""
        self.stage_seconds.labels(kind).observe(seconds)
        self.batch_rows.observe(rows)
        self.batch_calls.observe(calls)


class MeteredPool:
    """An in-process pool (`--transport local`, the pool inside the attention actor) with
    the same metrics a pool replica exports: each call is one forward of one call."""

    def __init__(self, pool, metrics: PoolMetrics):
        self.pool, self.metrics = pool, metrics
        self.name = pool.name

    @property
    def calls(self) -> int:
        return self.pool.calls

    def _timed(self, kind: str, rows: int, fn, *args):
        start = time.perf_counter()
        try:
            out = fn(*args)
        except Exception:
            self.metrics.failures.inc()
            raise
        self.metrics.observe(kind, time.perf_counter() - start, rows, 1)
        return out

    def stage(self, layer, u, positions):
        return self._timed("stage", u.shape[0], self.pool.stage, layer, u, positions)

    def score(self, u, targets, k):
        return self._timed("score", u.shape[0], self.pool.score, u, targets, k)

    def final(self, u, params, generators, histories=None):
        return self._timed("final", u.shape[0], self.pool.final, u, params, generators,
                           histories)
