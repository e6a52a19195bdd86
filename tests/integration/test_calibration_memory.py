"""Calibration streams: its peak memory does not grow with the amount of calibration text."""
from __future__ import annotations

import json
import textwrap

import pytest

from tests.fresh import run_fresh

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import json, resource, sys, tempfile
    import torch
    from models import load_model
    from models.random_checkpoint import load_configs, save_random_checkpoint
    from tools.calibration import CalibConfig, calibrate

    torch.set_num_threads(1)
    n_docs = int(sys.argv[1])
    cfg = dict(load_configs("tiny")["qwen3"], num_hidden_layers=4, hidden_size=256)
    with tempfile.TemporaryDirectory() as tmp:
        save_random_checkpoint(cfg, tmp, seed=0, std=0.1)
        model = load_model(tmp)

        def docs():                      # produced lazily, like files read one at a time
            g = torch.Generator().manual_seed(0)
            for _ in range(n_docs):
                yield torch.randint(0, 1000, (2048,), generator=g).tolist()

        summary = calibrate(model, docs(), CalibConfig(splits=(1,), max_len=2048,
                                                       heldout_docs=1), tmp + "/maps",
                            log=lambda *_: None)
    print(json.dumps({"peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "tokens": summary["calib_tokens"]}))
""")


def run(n_docs: int) -> dict:
    return json.loads(run_fresh(SCRIPT, str(n_docs)).strip().splitlines()[-1])


def test_peak_memory_is_flat_in_calibration_text():
    small, large = run(3), run(13)
    assert 2 * large["tokens"] == 12 * small["tokens"]      # 12 vs 2 fitted documents
    # holding the rows would add 10 docs × 2048 rows × 5 layers × 256 × 4 B ≈ 105 MB
    growth_mib = (large["peak_kib"] - small["peak_kib"]) / 1024
    assert growth_mib < 40, f"peak memory grew by {growth_mib:.0f} MiB with 6× the text"
