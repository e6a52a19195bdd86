"""The native CPU kernels as torch operators (`torch.ops.splitstack_cpu`), for compiled
decode steps: inductor's wrapper calls them through the dispatcher, with no Python between
the graph and the kernel.

`torch_ops.cpp` is built against the installed torch (its headers and libraries, so the
cache key includes torch's version and paths) and loaded with `torch.ops.load_library`; the
kernels themselves stay in their C files, loaded by ctypes, whose addresses it is given
(`bind`). At batch 1 the Python custom ops these replace spent more time in their own bodies
than in the kernels (`bench/serving/decode_compile.py`). bf16 products go to oneDNN's packed product
through the dispatcher, as `models.layers.project` does.

- `weight_table(entries)`: register a step's weights (`WeightEntry`: the native int8 copy,
  the oneDNN-packed bf16 weight, or both) and get the table's id; `release_table(id)`
  forgets it.
- `set_step(table, prepared, rows)` / `clear_step()`: what the ops read besides their
  tensors, for this thread: the weight table and the step's `cpu_paged.Prepared`.
- `torch.ops.splitstack_cpu.int8_linear(x [M, K], key, out_features)`: `cpu_int8.linear`
  on the table's weight `key`; `bf16_linear(x, key, out_features)`: oneDNN's product on its
  packed bf16 copy, plus its bias (`models.layers.project`'s bf16 path).
- `torch.ops.splitstack_cpu.paged_decode(q [B, H, D] fp32, k, v [B, KV, D], kv, layer,
  slots, scale)`: write the first `rows` rows' k, v into layer `layer` of the cache
  [2, layers, blocks, block_size, KV, D] at `slots`, then `cpu_paged.decode`'s O (fp32).

Without a C++ compiler, the torch headers or either kernel, `available()` is False and the
compiled step keeps its Python ops.
"""
from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from kernels import native
from kernels.attention import cpu_paged
from kernels.linear import cpu_int8

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("torch_ops.cpp")

_state: bool | None = None          # None: not tried yet
_lock = threading.Lock()


def _flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    from torch.utils import cpp_extension

    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    flags = ("-O2", "-std=c++20", "-fPIC", "-shared",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             f"-DSPLITSTACK_TORCH_VERSION=\"{torch.__version__}\"",
             *(f"-I{path}" for path in cpp_extension.include_paths()))
    return flags, (f"-L{lib_dir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}")


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0


def available() -> bool:
    """Build (once per source and torch) and load the operators, bound to both kernels."""
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                _state = _load()
    return _state


def _load() -> bool:
    if os.environ.get("SPLITSTACK_NATIVE_KERNELS", "1") == "0":
        return False
    int8_lib, paged_lib = cpu_int8.library(), cpu_paged.library()
    if int8_lib is None or paged_lib is None:
        return False
    try:
        path = native.build(SOURCE, *_flags())
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("native torch operators unavailable (%s); compiled steps keep Python "
                    "operators", err)
        return False
    _register_fakes()
    torch.ops.splitstack_cpu.bind(_address(int8_lib, "int8_linear"),
                                  _address(paged_lib, "paged_decode"))
    return True


class WeightEntry(NamedTuple):
    """One weight of a table: its native int8 copy and/or its bf16 weight in oneDNN's packed
    layout (with the product's bias), either None where the step keeps the Python op."""
    in_features: int
    out_features: int
    int8: cpu_int8.Packed | None = None
    bf16: torch.Tensor | None = None
    bias: torch.Tensor | None = None


def weight_table(entries: list[WeightEntry]) -> int:
    """Register the weights a step's `int8_linear` / `bf16_linear` keys index (key = index in
    `entries`); returns the table's id."""
    empty = torch.empty(0, dtype=torch.uint8)
    return torch.ops.splitstack_cpu.weight_table(
        [e.int8.data if e.int8 is not None else empty for e in entries],
        [e.int8.scales if e.int8 is not None else empty.float() for e in entries],
        [e.bf16 if e.bf16 is not None else empty.bfloat16() for e in entries],
        [e.bias if e.bf16 is not None else None for e in entries],
        [e.in_features for e in entries], [e.out_features for e in entries])


def release_table(table: int) -> None:
    torch.ops.splitstack_cpu.release_table(table)


def set_step(table: int, prepared: cpu_paged.Prepared, rows: int) -> None:
    """Set, for this thread, the weight table (0: none) and the step's prepared tables; the
    first `rows` rows are real (their k, v are written)."""
    p = prepared
    torch.ops.splitstack_cpu.set_step(table, p.tables, p.lens, p.part_acc, p.part_ml, rows,
                                      p.chunk, p.chunks, torch.get_num_threads())


def clear_step() -> None:
    torch.ops.splitstack_cpu.clear_step()


def _register_fakes() -> None:
    """Shapes for tracing (the operators are defined once the library is loaded)."""
    @torch.library.register_fake("splitstack_cpu::int8_linear")
    def _(x, key, out_features):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("splitstack_cpu::bf16_linear")
    def _(x, key, out_features):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("splitstack_cpu::paged_decode")
    def _(q, k, v, kv, layer, slots, scale):
        return torch.empty_like(q)
