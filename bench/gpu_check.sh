#!/usr/bin/env bash
# Every GPU test and GPU benchmark in one go, on a machine with one CUDA device: a few
# minutes when nothing hangs, and each step has its own time limit. Outputs go under $OUT
# (default: a new folder under /tmp), one file per step, and the exit codes and headline
# rows in $OUT/summary.txt.
#
#   bench/gpu_check.sh                  # install what is missing, tests, benchmarks
#   SKIP_INSTALL=1 bench/gpu_check.sh   # no pip at all (a machine without a registry)
#   FLASH_ATTN_BUILD_S=1800 bench/gpu_check.sh   # also build flash-attn from its sdist
#
# Install: the project's GPU extra (pyproject.toml: cupy-cuda12x, flash-attn). flash-attn
# is tried as a wheel only (--only-binary) unless FLASH_ATTN_BUILD_S > 0 gives the sdist
# build its own time limit; a failure is printed and the rest goes on (its tests then skip).
# Steps never stop the script: each one's exit code goes to the summary.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
PY=$PYTHON
OUT=${OUT:-$(mktemp -d -t gpu_check.XXXX)}
mkdir -p "$OUT"
echo "outputs: $OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
export PYTHONWARNINGS=ignore::UserWarning TOKENIZERS_PARALLELISM=false

step() {  # step NAME SECONDS CMD...: run CMD with a time limit, output to $OUT/NAME.txt
  local name=$1 limit=$2
  shift 2
  echo "== $name ($limit s): $*" | tee -a "$SUMMARY"
  local start=$SECONDS
  timeout --signal=INT --kill-after=20 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "   rc=$rc after $((SECONDS - start)) s" | tee -a "$SUMMARY"
  tail -n 3 "$OUT/$name.txt" | sed 's/^/   | /' | tee -a "$SUMMARY"
  return 0
}

step env 60 bash -c "git rev-parse HEAD; nvidia-smi; $PY -c 'import torch, sys; \
print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \
torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else \"\"); \
import triton; print(\"triton\", triton.__version__)'"

if [ -z "${SKIP_INSTALL:-}" ]; then
  PIP="$PY -m pip install --retries 0 --timeout 15"
  # the project and its test extra, only where this Python lacks them (a CUDA build of
  # torch 2.13.0 already installed satisfies the pin and stays)
  if ! $PY -c "import models, services.engine, prometheus_client, pytest, redis" 2>/dev/null; then
    step install_project 300 $PIP -e ".[test]"
  fi
  step install_gpu_extra 120 $PIP cupy-cuda12x
  if ! $PY -c "import flash_attn" 2>/dev/null; then
    step install_flash_attn_wheel 120 $PIP --only-binary :all: flash-attn
    if ! $PY -c "import flash_attn" 2>/dev/null && [ "${FLASH_ATTN_BUILD_S:-0}" -gt 0 ]; then
      step install_flash_attn_sdist "$FLASH_ATTN_BUILD_S" env MAX_JOBS=16 \
        $PIP --no-build-isolation flash-attn
    fi
  fi
fi
# the gRPC stubs the Ray and gRPC modules import (the Makefile's `proto` target)
if [ ! -f services/common/pb/splitstack_pb2.py ]; then
  step proto 60 $PY -m grpc_tools.protoc -Iservices/common/pb=proto --python_out=. --grpc_python_out=. services/common/pb/splitstack.proto
fi
$PY -c "import flash_attn; print('flash-attn', flash_attn.__version__)" >> "$SUMMARY" 2>/dev/null \
  || echo "flash-attn: not importable (its tests skip; see install_flash_attn_*.txt)" >> "$SUMMARY"

# every GPU-marked test; -rs lists each skip with its reason
step gpu_tests 300 $PY -m pytest -q -p no:cacheprovider -rs -m gpu tests/unit tests/integration
# the engine's CUDA paths again: delta rule on the Triton kernels, replay and decode graphs
step gpu_tests_triton_engine 180 env SPLITSTACK_GDN_KERNEL=triton SPLITSTACK_REPLAY_GRAPHS=1 SPLITSTACK_DECODE_GRAPHS=1 $PY -m pytest -q -p no:cacheprovider -rs tests/unit/test_gpu_paths.py

# Tail-Replay: 16K with r = 5% (acceptance: a hit >= 8x faster than full prefill), and 32K
step tailreplay_ttft 300 $PY -m bench.tail_replay.ttft --device cuda --prefixes 16384,32768 --ratios 0.05 --reps 3 --redis-url '' --gdn-kernel triton --replay-graphs --device-cache-bytes 8589934592
# the same at 16K on the torch kernels, no graphs, no device tier: the baseline
step tailreplay_ttft_baseline 180 $PY -m bench.tail_replay.ttft --device cuda --prefixes 16384 --ratios 0.05 --reps 3 --redis-url '' --gdn-kernel torch
# RidgeFill: the hybrid at 8K and 16K (acceptance: >= 85% of the bound)
step ridgefill_ttft 300 $PY -m bench.ridgefill.ttft --device cuda --families qwen3_5 --lengths 8192,16384 --reps 5 --gdn-kernel triton

{
  echo "== headline rows"
  grep -h "16384\|32768" "$OUT/tailreplay_ttft.txt" "$OUT/tailreplay_ttft_baseline.txt" 2>/dev/null
  grep -h "^| qwen3_5" "$OUT/ridgefill_ttft.txt" 2>/dev/null
  grep -h "passed\|failed\|error" "$OUT/gpu_tests.txt" "$OUT/gpu_tests_triton_engine.txt" 2>/dev/null | tail -n 4
} >> "$SUMMARY"
cat "$SUMMARY"
