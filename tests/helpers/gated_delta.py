"""Gated delta rule inputs and the token-by-token oracle, for checking a kernel against it
(the Triton kernel's GPU tests and its interpreter run, `bench/serving/triton_interpret.py`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.gated_delta import naive


def rel(a, b) -> float:
    """Relative error of `a` against `b` (Frobenius norms, in fp32)."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def inputs(t, hk=2, hv=4, dk=32, dv=32, b=2, seed=0, dtype=torch.float32, init=True):
    """(q, k, v, log decay, beta, initial state or None): `hk` key heads shared by `hv`
    value heads, q/k/v/beta in `dtype`, the decay and state in fp32."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(b, t, hv, dv, generator=g)
    decay = -F.softplus(torch.randn(b, t, hv, generator=g)) * 0.5    # a model's log decay
    beta = torch.rand(b, t, hv, generator=g)
    s0 = torch.randn(b, hv, dk, dv, generator=g) * 0.1 if init else None
    return [x.to(dtype) for x in (q, k, v)] + [decay, beta.to(dtype), s0]


def oracle(q, k, v, g, beta, s0):
    """The token-by-token rule in fp32, key heads repeated over their value heads."""
    r = v.shape[2] // k.shape[2]
    q, k = (x.float().repeat_interleave(r, dim=2) for x in (q, k))
    return naive.recurrent_gated_delta_rule(q, k, v.float(), g, beta.float(), s0)
