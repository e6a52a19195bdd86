"""docs/metrics.md's bucket table against the code: every histogram the series tables list
has one row, and its bounds are the ones the histogram is built with (read from a registry
where the gateway builds it, from the module's bucket constant elsewhere)."""
from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from services.deployment.members import cluster_client
from services.gateway.metrics import GatewayMetrics
from services.mlp_pool.metrics import CALL_BUCKETS, ROW_BUCKETS, STAGE_BUCKETS
from services.prefill.metrics import PREFILL_BUCKETS
from services.engine.metrics import ITERATION_TOKEN_BUCKETS
from services.engine.structured import COMPILE_BUCKETS, MASK_BUCKETS
from services.prefix_cache.metrics import REPLAY_BUCKETS

DOC = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
SERIES_ROW = re.compile(r"^\|\s*`(splitstack_\w+)`\s*\|\s*histogram\s*\|", re.M)
BUCKET_ROW = re.compile(r"^\|\s*`(splitstack_\w+)`\s*\|\s*([^|]*\d[^|]*)\|\s*$", re.M)
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])")


def declared(registry: CollectorRegistry) -> dict[str, list[float]]:
    out: dict[str, set[float]] = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name.endswith("_bucket") and s.labels["le"] != "+Inf":
                out.setdefault(s.name.removesuffix("_bucket"), set()).add(float(s.labels["le"]))
    return {name: sorted(bounds) for name, bounds in out.items()}


def in_code() -> dict[str, list[float]]:
    registry = CollectorRegistry()
    GatewayMetrics(registry)
    cluster_client(["127.0.0.1:1"], registry)      # migration pause; connects to nothing
    out = declared(registry)
    for name in ("splitstack_prefill_request_seconds", "splitstack_prefill_send_seconds",
                 "splitstack_prefill_seconds"):
        out[name] = sorted(map(float, PREFILL_BUCKETS))
    # labelled (or built per replica) histograms: no bucket sample before a label is used
    out["splitstack_pool_stage_seconds"] = sorted(map(float, STAGE_BUCKETS))
    out["splitstack_pool_batch_rows"] = sorted(map(float, ROW_BUCKETS))
    out["splitstack_pool_batch_calls"] = sorted(map(float, CALL_BUCKETS))
    for name in ("splitstack_prefix_cache_replay_seconds",
                 "splitstack_prefix_cache_transfer_seconds"):
        out[name] = sorted(map(float, REPLAY_BUCKETS))
    out["splitstack_grammar_compile_seconds"] = sorted(map(float, COMPILE_BUCKETS))
    out["splitstack_grammar_mask_seconds"] = sorted(map(float, MASK_BUCKETS))
    out["splitstack_iteration_tokens"] = sorted(map(float, ITERATION_TOKEN_BUCKETS))
    return out


def documented() -> dict[str, list[float]]:
    section = DOC[DOC.index("## Histogram buckets"):]
    section = section[:section.index("\n## ", 1)]
    return {name: [float(x) for x in NUMBER.findall(bounds)]
            for name, bounds in BUCKET_ROW.findall(section)}


def test_every_histogram_has_a_bucket_row():
    assert set(SERIES_ROW.findall(DOC)) == set(documented())


def test_bucket_rows_match_the_code():
    code = in_code()
    doc = documented()
    assert {name: code[name] for name in doc} == doc
