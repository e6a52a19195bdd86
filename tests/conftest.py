"""Shared fixtures: tiny random checkpoints of every family, saved once per session."""
from __future__ import annotations

import os

import pytest
import torch

from models.random_checkpoint import load_configs, save_random_checkpoint

torch.set_num_threads(min(2, os.cpu_count() or 1))

FAMILIES = ["qwen3", "llama3", "qwen3_next", "qwen3_next_moe", "qwen3_5"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_configs() -> dict[str, dict]:
    return load_configs("tiny")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_configs):
    """family -> (directory, HF model) with N(0, 0.1²) weights and random 1-D params.

    std 0.1 keeps fp32 rounding noise (which grows with activation size) well under the
    1e-4 logit tolerance; at 0.15 HF's own fp32 chunked path is ~1.5e-4 from an fp64 run.
    """
    cache: dict[str, tuple] = {}

    def get(family: str, std: float = 0.1, seed: int = 1):
        key = (family, std, seed)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{family}-{seed}")
            hf = save_random_checkpoint(tiny_configs[family], path, seed=seed, std=std)
            cache[key] = (path, hf)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster on loopback for the whole test session (it is slow to start
    on 2 cores); `ray.shutdown()` at the end ends only what this session started."""
    import ray

    from services.common.ray_deploy import init_ray

    init_ray(num_cpus=2)
    yield ray
    ray.shutdown()
