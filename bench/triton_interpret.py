"""The Triton delta-rule kernels run by Triton's interpreter on the CPU, against the oracle.

    pip install triton          # into the venv; not part of `make setup` (about 1 GB)
    python bench/triton_interpret.py

A check of the kernels' algorithm and indexing (padding, grouped heads, head sizes that are
not powers of two, initial state, wanted rows, state-only sweeps) without a GPU; what only
compiled code shows (tl.dot's shapes and precision on the device, registers, speed) needs
one (tests/unit/test_kernels_triton_gpu.py). Prints the relative error per case; exits 1
when one is above 1e-5.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"          # before Triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.gated_delta import naive, triton_chunked  # noqa: E402


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def inputs(t, hk=2, hv=4, dk=32, dv=32, b=2, seed=0, dtype=torch.float32, init=True):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(b, t, hv, dv, generator=g)
    decay = -F.softplus(torch.randn(b, t, hv, generator=g)) * 0.5
    beta = torch.rand(b, t, hv, generator=g)
    s0 = torch.randn(b, hv, dk, dv, generator=g) * 0.1 if init else None
    return [x.to(dtype) for x in (q, k, v)] + [decay, beta.to(dtype), s0]


def oracle(q, k, v, g, beta, s0):
    r = v.shape[2] // k.shape[2]
    q, k = (x.float().repeat_interleave(r, dim=2) for x in (q, k))
    return naive.recurrent_gated_delta_rule(q, k, v.float(), g, beta.float(), s0)


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
