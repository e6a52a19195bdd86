"""What the engine counts over its steps, and the Prometheus collector that exports it
(vLLM's engine-level series): preemptions, tokens per step, the speculative-decoding
counters and the cache configuration. The engine keeps plain counts (`StepStats`); the
collector reads them when the registry is scraped, so a step pays no metrics call."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.utils import floatToGoString

# tokens one step computes: a decode batch up to a long prefill chunk (vLLM's buckets are
# its graph capture sizes up to max_num_batched_tokens)
ITERATION_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                           16384)


@dataclass
class Tally:
    """A histogram's counts, kept without a registry: `counts[i]` observations at most
    `buckets[i]` and above the bucket before it (the last slot: above every bucket)."""
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        cumulative, running = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            cumulative.append((floatToGoString(bound), running))
        return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=self.total)


@dataclass
class StepStats:
    preemptions: int = 0       # sequences preempted (their KV freed, recomputed later)
    iteration_tokens: Tally = field(default_factory=lambda: Tally(ITERATION_TOKEN_BUCKETS))


class EngineCollector:
    """The engine's series, read from its `StepStats`, `SpecStats` and configuration."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e = self.engine
        yield CounterMetricFamily("splitstack_num_preemptions", "Sequences preempted: their "
                                  "KV freed for older ones, recomputed later",
                                  value=e.stats.preemptions)
        yield e.stats.iteration_tokens.family("splitstack_iteration_tokens",
                                              "Tokens computed per engine step (decode rows "
                                              "and prefill chunk rows)")
        spec = e.spec_stats
        for name, doc, value in (
                ("drafts", "Speculative steps: a request's draft verified", spec.drafts),
                ("draft_tokens", "Draft tokens proposed (n-gram lookup)", spec.draft_tokens),
                ("accepted_tokens", "Draft tokens accepted", spec.accepted_tokens)):
            yield CounterMetricFamily(f"splitstack_spec_decode_num_{name}", doc, value=value)
        info = GaugeMetricFamily("splitstack_cache_config_info", "The engine's KV cache and "
                                 "batch configuration (the value is 1)",
                                 labels=["block_size", "num_blocks", "max_num_seqs"])
        info.add_metric([str(e.blocks.block_size), str(e.blocks.num_blocks),
                         str(e.config.max_num_seqs)], 1)
        yield info
