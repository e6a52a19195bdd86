"""bench/gpu_check.sh, checked on the CPU: valid bash, every path and benchmark module it
names exists, and every benchmark flag it passes is one the benchmark's argparse accepts."""
from __future__ import annotations

import importlib
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def lines() -> list[str]:
    return [l for l in SCRIPT.read_text().splitlines() if l.strip() and not l.startswith("#")]


def bench_calls() -> list[tuple[str, list[str]]]:
    calls = []
    for line in lines():
        m = re.search(r"\$PY -m (bench(?:\.\w+)+)(.*)$", line)
        if m:
            calls.append((m.group(1), shlex.split(m.group(2))))
    return calls


def test_script_is_valid_bash_and_executable():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    assert SCRIPT.stat().st_mode & 0o111


def test_named_paths_exist_and_test_files_hold_gpu_tests():
    text = SCRIPT.read_text()
    paths = set(re.findall(r"\b((?:bench|tests)/[\w/]+(?:\.py|\.sh)?)\b", text))
    assert "tests/unit" in paths
    for p in paths:
        assert (ROOT / p).exists(), p
    modules = {script for script, _ in bench_calls()}
    assert {"bench.tail_replay.ttft", "bench.ridgefill.ttft"} <= modules
    assert "pytest.mark.gpu" in (ROOT / "tests/unit/test_kernels_triton_gpu.py").read_text()
    assert "-m gpu tests/unit tests/integration" in text


@pytest.mark.parametrize("script, argv", bench_calls(), ids=lambda x: str(x)[:40])
def test_benchmark_flags_parse(script, argv):
    module = importlib.import_module(script)       # fails on a module that is not there
    args = module.build_parser().parse_args(argv)      # exits (fails the test) on a bad flag
    assert args.device == "cuda"


def test_every_acceptance_benchmark_is_run():
    calls = {(s, " ".join(a)) for s, a in bench_calls()}
    assert any(s == "bench.tail_replay.ttft" and "--prefixes 16384" in a
               and "--ratios 0.05" in a for s, a in calls)
    assert any(s == "bench.ridgefill.ttft" and "--families qwen3_5" in a
               and "--lengths 8192,16384" in a for s, a in calls)
