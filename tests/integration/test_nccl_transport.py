"""The `nccl` transport between GPU actors (needs two CUDA devices: NCCL refuses two ranks
on one device). Skipped on machines without them, like CI."""
from __future__ import annotations

import pytest
import torch

from models import load_model
from services.common.ray_deploy import ClusterConfig, deploy
from services.engine import LLMEngine
from tests.integration.test_ray_deploy import PARAMS, assert_no_leaks, prompts, run_concurrently

pytestmark = [pytest.mark.gpu,
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

