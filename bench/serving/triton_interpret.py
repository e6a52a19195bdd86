"""The Triton delta-rule kernels run by Triton's interpreter on the CPU, against the oracle.

    pip install triton          # into the venv; not part of `make setup` (about 1 GB)
    python -m bench.serving.triton_interpret

A check of the kernels' algorithm and indexing (padding, grouped heads, head sizes that are
not powers of two, initial state, wanted rows, state-only sweeps) without a GPU; what only
compiled code shows (tl.dot's shapes and precision on the device, registers, speed) needs
one (tests/unit/test_kernels_triton_gpu.py). Prints the relative error per case; exits 1
when one is above 1e-5.
"""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"          # before Triton is imported

import torch

from kernels.gated_delta import triton_chunked
from tests.helpers.gated_delta import inputs, oracle, rel


def main() -> int:
    torch.set_num_threads(1)
    cases = [dict(t=1), dict(t=63), dict(t=100, seed=1),
             dict(t=150, hk=1, hv=3, dk=48, dv=80, b=1), dict(t=70, init=False),
             dict(t=100, dtype=torch.bfloat16)]
    worst = 0.0
    for case in cases:
        xs = inputs(**case)
        o_ref, s_ref = oracle(*xs)
        o, s = triton_chunked.chunk_gated_delta_rule(*xs)
        errs = rel(o, o_ref), rel(s, s_ref)
        worst = max(worst, *errs)
        print(f"{case}: output {errs[0]:.1e}, state {errs[1]:.1e}", flush=True)
    xs = inputs(200, seed=5)
    o_ref, s_ref = oracle(*xs)
    want = torch.zeros(200, dtype=torch.bool)
    want[[3, 199]] = True                                   # chunks 0 and 3 of 4
    o, s = triton_chunked.chunk_gated_delta_rule(*xs, out_rows=want)
    errs = rel(s, s_ref), rel(o[:, :64], o_ref[:, :64]), rel(o[:, 192:], o_ref[:, 192:])
    unwritten = o[:, 64:192].abs().max().item()
    print(f"wanted rows 3, 199: state {errs[0]:.1e}, chunk 0 {errs[1]:.1e}, chunk 3 "
          f"{errs[2]:.1e}, other rows max |o| {unwritten}")
    o, s = triton_chunked.chunk_gated_delta_rule(*xs, out_rows=torch.zeros(200, dtype=torch.bool))
    print(f"state only: state {rel(s, s_ref):.1e}, max |o| {o.abs().max().item()}")
    worst = max(worst, *errs, rel(s, s_ref), unwritten, o.abs().max().item())
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
