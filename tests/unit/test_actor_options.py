"""Pool members always ask for their pool's Ray resource, whatever the cluster holds when
they are placed (a gateway may place them before the worker pods have joined)."""
from __future__ import annotations

import pytest

from services.deployment.ray_cluster import POOLS, ClusterConfig, actor_options, pool_resource


@pytest.mark.parametrize("pool", POOLS)
def test_a_member_asks_for_its_pools_resource_before_any_worker_joins(pool, monkeypatch):
    ray = pytest.importorskip("ray")
    # a fresh install: only the head and the gateway (no pool resource) have joined so far
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 0.0, "memory": 1e9})
    for use_gpu in (False, True):
        opts = actor_options(ClusterConfig(model="m", use_gpu=use_gpu), pool)
        assert opts["resources"] == {pool_resource(pool): 1}
        assert opts["num_cpus"] == 0 and opts["num_gpus"] == (1 if use_gpu else 0)
