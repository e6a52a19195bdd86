"""`splitstack eval` on the held-out families with the real model: CI's smoke version of
the held-out eval (one item per family at 512 tokens, one loss document from the long
texts)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evals.heldout.families import FAMILIES
from evals.heldout.texts import SOURCE_NAME

pytestmark = pytest.mark.slow

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo" / "smollm2-135m"


def test_heldout_families_in_the_eval_cli(tmp_path):
    out = tmp_path / "heldout.json"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "eval", "--model", str(ZOO), "--arms", "exact",
         "--lengths", "512", "--tasks", "", "--families", "all", "--n-items", "1",
         "--n-docs", "1", "--loss-corpus", "long", "--tail-len", "128", "--threads", "1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    exact = summary["arms"]["exact"]
    assert summary["loss_corpus"] == {"512": SOURCE_NAME}
    assert summary["heldout_sources"]["python-reference"] > 0
    assert exact["loss"]["docs@512"]["n"] == 1 and 0.3 < exact["loss"]["docs@512"]["mean"] < 6
    assert set(exact["retrieval"]) == {f"{f}@512" for f in FAMILIES} | {"all"}
    for family in FAMILIES:
        s = exact["retrieval"][f"{family}@512"]
        assert s["n"] == 1 and s["mean"] in (0.0, 1.0)
    # what the model answered is kept, item by item, and agrees with the scores
    done = summary["completions"]["exact"]
    assert sorted(c["task"] for c in done) == sorted(FAMILIES)
    for c in done:
        assert c["length"] == 512 and c["score"] == exact["retrieval"][f"{c['task']}@512"]["mean"]
        assert c["score"] == float(all(a in c["completion"] for a in c["answers"]))
    # SmolLM2-135M finds the classic pass key (12/12 at 2K in the full held-out run)
    assert exact["retrieval"]["passkey@512"]["mean"] == 1.0
    assert "| `exact` | passkey (held-out) | 100% [100, 100] (1) |" in proc.stdout
    assert f"512 tokens from {SOURCE_NAME}" in proc.stdout
