"""A small `splitstack eval` on the real model, as CI's smoke version of the harness."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo" / "smollm2-135m"


def test_eval_cli_smoke(tmp_path):
    out = tmp_path / "eval.json"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "eval", "--model", str(ZOO), "--arms", "exact",
         "--lengths", "512", "--tasks", "single,multikey", "--n-items", "2", "--n-docs", "1",
         "--tail-len", "128", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    exact = summary["arms"]["exact"]
    assert summary["corpus"] == "python-stdlib-docstrings"
    # the exact arm agrees with itself perfectly; losses are finite and plausible for text
    assert exact["top1_agreement"]["docs@512"]["mean"] == 1.0
    assert exact["kl_mean"]["docs@512"]["mean"] == 0.0
    assert 0.5 < exact["loss"]["docs@512"]["mean"] < 6.0
    for task in ("single@512", "multikey@512"):
        s = exact["retrieval"][task]
        assert s["n"] == 2 and 0.0 <= s["ci"][0] <= s["mean"] <= s["ci"][1] <= 1.0
    assert exact["retrieval"]["single@512"]["mean"] == 1.0       # a short, easy needle
    assert "| retrieval | single@512 |" in proc.stdout and out.with_suffix(".md").exists()
