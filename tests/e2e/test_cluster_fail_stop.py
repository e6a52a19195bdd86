"""Fail stop in the Ray deployment (2 attention services, 2 MLP pool replicas, grpc):
`SPLITSTACK_FAULT_INJECT` kills attention-0's step loop mid-stream and pool-0 at one of
its stage calls. The attention service's calls end UNAVAILABLE, as a killed one's would:
the gateway migrates its requests, which finish with the exact engine's tokens; pool-0's
calls are retried on pool-1. Both dead members exit, the pool manager replaces them, and
no KV block leaks on any attention service."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from services.deployment.ray_cluster import ClusterConfig
from services.deployment.server import build_cluster
from tests.helpers.gateway import (ZOO, migrations, reference_texts, running,
                                   stream_completion)

pytestmark = pytest.mark.slow

MAX_TOKENS = 40
# attention-0's 24th step comes mid-stream (a prefill step or two, then decode steps of
# the two requests it owns); pool-0's 400th stage call (two per layer and step) too
FAULTS = "engine_step:24@attention-0,pool_call:400@pool-0"


def prompt_ids():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(100, 20000, (n,), generator=gen).tolist() for n in (9, 31, 17, 4)]


@pytest.fixture(scope="module")
def reference():
    return reference_texts(prompt_ids(), MAX_TOKENS)


def members(base: str, pool: str) -> list[dict]:
    pools = httpx.get(base + "/admin/pools", timeout=30).json()["data"]
    return next(p for p in pools if p["pool"] == pool)["members"]


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.5)
    return got


def test_a_failed_attention_service_migrates_and_dead_members_are_replaced(ray_session,
                                                                           reference):
    config = ClusterConfig(model=str(ZOO), attention_shards=2, mlp_replicas=2,
                           transport="grpc", kv_cache_bytes=64 << 20, max_num_seqs=8,
                           fault_inject=FAULTS)
    app, cluster = build_cluster(config, served_name="smollm2-135m")
    try:
        with running(app) as base:
            starts = [threading.Event() for _ in prompt_ids()]
            with ThreadPoolExecutor(4) as ex:
                futures = [ex.submit(stream_completion, base, ids, MAX_TOKENS, ev)
                           for ids, ev in zip(prompt_ids(), starts)]
                results = [f.result(timeout=300) for f in futures]
            assert all(err is None for _, err in results), results
            assert [text for text, _ in results] == reference
            assert migrations(base, "failure") >= 1       # attention-0 owned some of them

            def replaced(pool: str, dead: str):
                now = members(base, pool)
                names = [m["name"] for m in now]
                return (dead not in names and len(now) == 2
                        and all(m["state"] == "ready" for m in now)) and now

            attention = wait_for(lambda: replaced("attention", "attention-0"), 240,
                                 "attention-0 was not replaced")
            pools = wait_for(lambda: replaced("mlp", "pool-0"), 240, "pool-0 was not replaced")
            assert {m["name"] for m in attention} == {"attention-1", "attention-2"}
            assert {m["name"] for m in pools} == {"pool-1", "pool-2"}
            assert httpx.get(base + "/health").status_code == 200
            assert httpx.get(base + "/ready").status_code == 200

            again = [stream_completion(base, ids, MAX_TOKENS) for ids in prompt_ids()]
            assert [t for t, _ in again] == reference and all(e is None for _, e in again)
            for actor in cluster.attention:           # the live ones, the replacement too
                free, total = ray_session.get(actor.blocks.remote())
                assert free == total
            assert len(cluster.attention) == 2 and len(cluster.pools) == 2
    finally:
        cluster.shutdown()
