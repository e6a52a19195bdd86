"""Shared fixtures (tiny random checkpoints of every family, saved once per session; one Ray
session) and the collection rules: `gpu` tests skip without CUDA, and HTTP end-to-end and Ray
tests must carry `slow` so that `make test-fast` stays free of them."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from models import load_model
from models.random_checkpoint import load_configs, save_random_checkpoint
from tools.calibration import CalibConfig, calibrate

torch.set_num_threads(min(2, os.cpu_count() or 1))

E2E = Path(__file__).resolve().parent / "e2e"


def needs_slow_mark(item) -> bool:
    """Tests over HTTP end to end (tests/e2e/) or on a Ray cluster."""
    return (E2E in item.path.resolve().parents
            or "ray_session" in getattr(item, "fixturenames", ()))


@pytest.hookimpl(tryfirst=True)     # before -m and -k deselect: every run checks everything
def pytest_collection_modifyitems(config, items):
    unmarked = sorted({item.nodeid.split("::")[0] for item in items
                       if needs_slow_mark(item) and item.get_closest_marker("slow") is None})
    if unmarked:
        raise pytest.UsageError("HTTP end-to-end and Ray tests must be marked `slow` (`make "
                                "test-fast` skips them); unmarked ones in: " + ", ".join(unmarked))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def subnormals_as_they_were():
    """`splitstack`'s `main` flushes subnormals to zero for its whole process
    (`services.common.process`); a test that runs it in this process must not leave that
    on for the tests after it (Hypothesis, for one, refuses to draw floats under it)."""
    yield
    torch.set_flush_denormal(False)


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
    on 2 cores); `ray.shutdown()` at the end ends only what this fixture started."""
    import ray

    from services.deployment.ray_cluster import init_ray

    init_ray(num_cpus=2)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def four_layer(tmp_path_factory, tiny_configs):
    """family -> (model, maps_dir): 4-layer tiny checkpoints with RidgeFill maps for splits 1
    and 2, built once per test module (tests may write beside the maps)."""
    out = {}

    def get(family):
        if family not in out:
            cfg = dict(tiny_configs[family], num_hidden_layers=4)
            cfg.pop("layer_types", None)
            path = tmp_path_factory.mktemp(f"rf-{family}")
            save_random_checkpoint(cfg, path, seed=3, std=0.1)
            model = load_model(path)
            g = torch.Generator().manual_seed(0)
            docs = [torch.randint(0, 1000, (200,), generator=g).tolist() for _ in range(6)]
            maps_dir = path / "maps"
            # random weights have no attention sink: every row is fitted (and fillable);
            # test_sink_rows_stay_out_of_the_fit_and_exact covers the default
            calibrate(model, iter(docs), CalibConfig(splits=(1, 2), max_len=128, heldout_docs=2,
                                                     sink_rows=0),
                      maps_dir, log=lambda *_: None)
            out[family] = (model, maps_dir)
        return out[family]

    return get
