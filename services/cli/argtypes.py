"""argparse value types shared by the `splitstack` commands and the tools behind them: a
bad value is a usage error naming the option, raised before anything loads."""
from __future__ import annotations

import argparse

import torch

from kernels.native import cpu_flags

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cpu_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX): there bf16 weights
    halve what a decode step reads at no cost in speed; elsewhere bf16 is emulated, slower."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, gpu: bool = False) -> str:
    """`auto` -> bfloat16 on a CPU with native bf16, float32 otherwise (and on a GPU, where
    the choice is left explicit); other names pass through."""
    if name != "auto":
        return name
    return "bfloat16" if not gpu and cpu_native_bf16() else "float32"


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers (--token-ids, --splits, --lengths)."""
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def in_range(value, low: float | None, high: float | None) -> bool:
    """low ≤ value ≤ high, either bound optional; NaN is never in range."""
    return (low is None or value >= low) and (high is None or value <= high) and value == value


def describe_range(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f"in [{low}, {high}]"
    return f"≥ {low}" if low is not None else f"≤ {high}"


def bounded(low: float | None, kind=int, high: float | None = None):
    """A `kind` number in [low, high] (a port, a count, a size, a share)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}")
        if not in_range(value, low, high):
            raise argparse.ArgumentTypeError(f"must be {describe_range(low, high)}, got {text}")
        return value
    return parse
