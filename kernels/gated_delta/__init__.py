"""Gated delta rule (Gated DeltaNet core): recurrent reference and chunked form.

`chunk_gated_delta_rule` runs the torch chunked form (`chunked.py`), or on CUDA the fused
Triton kernels (`triton_chunked.py`) when `SPLITSTACK_GDN_KERNEL=triton` and they take the
inputs (no autograd, a supported dtype and head size); anything else keeps the torch form.
"""
from __future__ import annotations

import os

from kernels.gated_delta import chunked
from kernels.gated_delta.naive import l2norm, recurrent_gated_delta_rule

KERNEL_ENV = "SPLITSTACK_GDN_KERNEL"
KERNELS = ("torch", "triton")


def kernel_choice() -> str:
    """The chunked kernel `SPLITSTACK_GDN_KERNEL` asks for: torch (default) or triton."""
    name = os.environ.get(KERNEL_ENV, "torch") or "torch"
    if name not in KERNELS:
        raise ValueError(f"{KERNEL_ENV} must be one of {', '.join(KERNELS)}, got {name!r}")
    return name


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, **kwargs):
    """`chunked.chunk_gated_delta_rule`'s contract, on the kernel `kernel_choice()` names."""
    if q.is_cuda and kernel_choice() == "triton":
        from kernels.gated_delta import triton_chunked
        if triton_chunked.supported(q, k, v, kwargs.get("chunk_size", 64)):
            return triton_chunked.chunk_gated_delta_rule(q, k, v, g, beta, initial_state,
                                                         **kwargs)
    return chunked.chunk_gated_delta_rule(q, k, v, g, beta, initial_state, **kwargs)


__all__ = ["chunk_gated_delta_rule", "kernel_choice", "recurrent_gated_delta_rule", "l2norm"]
