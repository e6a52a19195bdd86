"""The CI version of `bench/serving/soak.py`: 60 seconds of traffic in all (5 s of warm-up
and 25 s measured per deployment) at concurrency 16 against `splitstack serve` with
SmolLM2, embedded and disaggregated on Ray, each in its own process on loopback. Both
must end with 0 unexpected errors, 0 KV blocks held, RSS outside the KV caches' maps
within 10% of after warm-up, `/health` fine and no secret in the server's log. The
10-minute run's figures are in docs/results/soak.md."""
from __future__ import annotations

import json

import pytest

from bench.common import MODEL
from bench.serving.soak import soak

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("deployment", ["embedded", "ray"])
def test_soak(deployment, tmp_path):
    result = soak(deployment, seconds=25, concurrency=16, model=MODEL, warmup_s=5,
                  log_dir=tmp_path)
    print("\n" + json.dumps(result))
    assert result["total_requests"] > 0 and result["requests"].get("bad")
    assert result["unexpected_errors"] == 0, result["unexpected_samples"]
    assert not any(result["kv_in_use_after"].values()), result["kv_in_use_after"]
    assert all(g <= 0.10 for g in result["rss_growth"]), result
    assert result["health_after"] == 200 and not result["secret_in_logs"]
    assert result["passed"]
