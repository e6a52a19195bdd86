"""Flush subnormal floats to zero in CPU arithmetic, on every compute thread.

The gated delta rule's chunked form inverts a unit lower-triangular matrix per chunk (the
WY form's (I + A)⁻¹). Its far off-diagonal entries are long products of small factors, and
with the state's decays they reach float32's subnormal range (below 1.2e−38). x86 handles
subnormal operands in microcode, up to ~100× slower per operation: in the chunked rule at
8K tokens the triangular solves took 10× and the state products 8× longer than with
subnormals flushed, so a whole Gated DeltaNet layer ran 1.3–2.2× slower, on the zoo's
hybrid as on the bench hybrid. A subnormal is more than 30 orders of magnitude below
float32's resolution of the O(1) terms it is summed with, so flushing it changes no result
that float32 can tell apart (TensorFlow flushes by default for the same reason).

`torch.set_flush_denormal` sets the FTZ/DAZ bits of the calling thread only. Threads
inherit the bits of the thread that creates them, so the call must come before the first
parallel operation creates PyTorch's OpenMP workers: every `splitstack` command makes it
first thing in `main`, each Ray replica first thing in its constructor, and the TTFT benches
at start-up. `SPLITSTACK_FLUSH_DENORMALS=0` leaves the CPU as it is.
"""
from __future__ import annotations

import os

import torch


def flush_denormals(enable: bool = True) -> bool:
    """Flush subnormals to zero (`enable`), or stop flushing. Returns whether flushing is
    now on: False on a CPU without the mode, or when `SPLITSTACK_FLUSH_DENORMALS=0`."""
    if enable and os.environ.get("SPLITSTACK_FLUSH_DENORMALS", "1") == "0":
        return False
    return bool(torch.set_flush_denormal(enable)) and enable
