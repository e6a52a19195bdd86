"""Flush subnormal floats to zero in CPU arithmetic, on every compute thread.

Gated DeltaNet heads with strong decays (a log-decay of more than about 1.4 per token) put
float32 subnormals (below 1.2e−38) into the chunked delta rule: the decay factors
e^{γ_i − γ_j} across a 64-token chunk, and from them the WY form's (I + A)⁻¹ and the state
products. x86 computes on subnormal operands in microcode, up to ~100× slower per operation.
In the bench hybrid (random weights; log-decays per token of up to 3–6, median 0.4–1.4)
the triangular solves took 10× and the state products 8× longer than with subnormals
flushed, and a whole Gated DeltaNet layer at 8K tokens 2× longer. The zoo's distilled
hybrid decays gently (at most 0.2 per token): its solves see no subnormals, and flushing
changes nothing there, nor in the dense models; a checkpoint with fast-forgetting heads
pays it. A subnormal lies more than 30 orders of magnitude below float32's
resolution of the O(1) terms it is summed with, so flushing it changes no result float32
can tell apart (TensorFlow flushes by default for the same reason).

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
