"""Which CPU product a decode step's projections should use: `F.linear` (what HF runs),
`W @ xᵀ`, or MKL's packed GEMM, per row count and weight shape (the `bench` qwen3 config's
projections and LM head). Median of N timed loops, all in one process.

    python -m bench.serving.linear_products [--rows 1,8] [--threads 2] [--repeats 9]

`models.layers.project` takes `W @ xᵀ` for 2..64 rows, and for one row `F.linear`, or the
packed product when the weight is bigger than the caches (`PACK_MIN_BYTES`).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from models.layers import project

SHAPES = [(512, 512, "q / o"), (512, 256, "k / v"), (512, 1536, "gate / up"),
          (1536, 512, "down"), (512, 32768, "LM head")]


def timed(fn, repeats: int, loops: int) -> float:
    for _ in range(3):
        fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        runs.append((time.perf_counter() - start) / loops)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, median of {args.repeats}, times in µs\n")
    print("| rows | product | shape | `F.linear` | `W @ xᵀ` | MKL packed | `project` |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            for k, n, name in SHAPES:
                x, w = torch.randn(rows, k), torch.randn(n, k)
                loops = max(2, int(2e6 // (n * k)))
                packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
                t = [timed(f, args.repeats, loops) * 1e6 for f in (
                    lambda: F.linear(x, w),
                    lambda: (w @ x.T).T.contiguous(),
                    lambda: torch.ops.mkl._mkl_linear(x, packed, w, None, rows),
                    lambda: project(x, w))]
                print(f"| {rows} | {name} | {k} → {n} | " + " | ".join(f"{v:.0f}" for v in t)
                      + " |", flush=True)


if __name__ == "__main__":
    main()
