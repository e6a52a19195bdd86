"""The `nccl` transport between GPU actors (needs two CUDA devices: NCCL refuses two ranks
on one device). Skipped on machines without them, like CI."""
from __future__ import annotations

import pytest
import torch

from models import load_model
from services.deployment.ray_cluster import ClusterConfig, deploy
from services.engine import LLMEngine
from tests.helpers.cluster import PARAMS, assert_no_leaks, prompts, run_concurrently

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason="the nccl transport needs two CUDA devices")]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_nccl_transport_matches_exact_engine(family, tiny_checkpoint, ray_session):
    path, _ = tiny_checkpoint(family)
    ref = [s.output_ids for s in
           LLMEngine(load_model(path, device="cuda")).generate(prompts(), PARAMS)]
    cluster = deploy(ClusterConfig(model=str(path), transport="nccl", use_gpu=True,
                                   kv_splits=2, block_size=4, kv_cache_bytes=1 << 20))
    try:
        assert run_concurrently(cluster.attention_addresses[0], prompts()) == ref
        assert_no_leaks(ray_session, cluster)
        assert ray_session.get(cluster.pools[0].calls.remote()) > 0
    finally:
        cluster.shutdown()



@pytest.mark.skipif(torch.cuda.device_count() < 3,
                    reason="pool, prefill and attention actors each take a CUDA device")
def test_nccl_prefill_replica_matches_exact_engine(tiny_checkpoint, ray_session):
    """Prompts prefilled by a prefill replica, their KV and GDN states pulled over NCCL."""
    path, _ = tiny_checkpoint("qwen3_next")
    ref = [s.output_ids for s in
           LLMEngine(load_model(path, device="cuda")).generate(prompts(), PARAMS)]
    cluster = deploy(ClusterConfig(model=str(path), transport="nccl", use_gpu=True,
                                   prefill_replicas=1, kv_splits=2, block_size=4,
                                   kv_cache_bytes=1 << 20))
    try:
        assert run_concurrently(cluster.attention_addresses[0], prompts()) == ref
        assert_no_leaks(ray_session, cluster)
        free, total = ray_session.get(cluster.prefills[0].blocks.remote())
        assert free == total
    finally:
        cluster.shutdown()
