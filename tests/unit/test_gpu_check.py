"""bench/gpu_check.sh, checked on the CPU: valid bash, every path it names exists, and every
benchmark flag it passes is one the benchmark's argparse accepts."""
from __future__ import annotations

import importlib.util
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
        m = re.search(r"\$PY (bench/\w+\.py)(.*)$", line)
        if m:
            calls.append((m.group(1), shlex.split(m.group(2))))
    return calls


def test_script_is_valid_bash_and_executable():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    assert SCRIPT.stat().st_mode & 0o111


def test_named_paths_exist_and_test_files_hold_gpu_tests():
    text = SCRIPT.read_text()
    paths = set(re.findall(r"\b((?:bench|tests)/[\w/]+(?:\.py|\.sh)?)\b", text))
    assert {"bench/tailreplay_ttft.py", "bench/ridgefill_ttft.py", "tests/unit"} <= paths
    for p in paths:
        assert (ROOT / p).exists(), p
    assert "pytest.mark.gpu" in (ROOT / "tests/unit/test_kernels_triton_gpu.py").read_text()
    assert "-m gpu tests/unit tests/integration" in text


@pytest.mark.parametrize("script, argv", bench_calls(), ids=lambda x: str(x)[:40])
def test_benchmark_flags_parse(script, argv):
    spec = importlib.util.spec_from_file_location(Path(script).stem, ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.build_parser().parse_args(argv)      # exits (fails the test) on a bad flag
    assert args.device == "cuda"


def test_every_acceptance_benchmark_is_run():
    calls = {(s, " ".join(a)) for s, a in bench_calls()}
    assert any(s == "bench/tailreplay_ttft.py" and "--prefixes 16384" in a
               and "--ratios 0.05" in a for s, a in calls)
    assert any(s == "bench/ridgefill_ttft.py" and "--families qwen3_5" in a
               and "--lengths 8192,16384" in a for s, a in calls)
