"""Batched paged decode attention on the CPU: one native call per layer for the whole batch.

`decode(q, k_cache, v_cache, block_tables, kv_lens)` is `naive.paged_attention_lse` for
one query token per sequence (each row sees its first `kv_lens[b]` positions), computed by
`cpu_paged.c` reading the paged cache in place, whatever the lengths and however the
blocks are scattered. Built and loaded by `kernels.native`; without a compiler,
`available()` is False and callers keep the torch path.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch

from kernels import native

SOURCE = Path(__file__).with_name("cpu_paged.c")
FLAGS = (*native.FLAGS, "-ffast-math", "-fno-finite-math-only")
CHUNK = 256          # keys per work item: small enough to split one long row over threads
MAX_CHUNK = 512      # the C file's score buffer
MAX_GROUP, MAX_HEAD_DIM = 32, 256

_lib: ctypes.CDLL | None | bool = False      # False: not tried yet; None: unavailable


def build() -> Path:
    """Compile the kernel (once per source, flags and CPU) and return the library's path."""
    return native.build(SOURCE, FLAGS)


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.paged_decode.argtypes = [ptr, ptr, ptr, i, ptr, i64, ptr, i, i, i, i, i, i64, i64, i64,
                                 f, i, i, i, ptr, ptr, ptr, ptr]
    lib.paged_decode.restype = i


def library() -> ctypes.CDLL | None:
    global _lib
    if _lib is False:
        _lib = native.load(SOURCE, _declare, FLAGS)
    return _lib


def available() -> bool:
    return library() is not None


def supports(q: torch.Tensor, cache: torch.Tensor, kv_heads: int, head_dim: int) -> bool:
    """Whether `decode` takes these tensors (CPU, fp32/bf16 cache, head sizes in range)."""
    h = q.shape[-2]
    return (q.is_cpu and cache.is_cpu and cache.dtype in (torch.float32, torch.bfloat16)
            and h % kv_heads == 0 and h // kv_heads <= MAX_GROUP and head_dim <= MAX_HEAD_DIM
            and available())


class Prepared(NamedTuple):
    """What `decode` needs besides q and the caches, built once per step and reused by every
    layer: int64 tables and lengths, the chunk count and the partials' scratch."""
    tables: torch.Tensor
    lens: torch.Tensor
    chunk: int
    chunks: int
    part_acc: torch.Tensor
    part_ml: torch.Tensor


def prepare(block_tables: torch.Tensor, kv_lens: torch.Tensor, block_size: int, num_heads: int,
            head_dim: int, *, chunk: int = CHUNK) -> Prepared:
    if not 0 < chunk <= MAX_CHUNK:
        raise ValueError(f"chunk must be in 1..{MAX_CHUNK}")
    tables = block_tables.to(torch.int64).contiguous()
    lens = kv_lens.to(torch.int64).contiguous()
    b = lens.shape[0]
    longest = int(lens.max()) if b else 0
    if longest > tables.shape[1] * block_size:
        raise ValueError(f"kv_lens {longest} exceeds the block tables' "
                         f"{tables.shape[1] * block_size}")
    nc = max(1, -(-longest // chunk))
    return Prepared(tables, lens, chunk, nc, torch.empty(b * nc * num_heads * head_dim),
                    torch.empty(b * nc * num_heads * 2))


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor | None = None, kv_lens: torch.Tensor | None = None, *,
           scale: float | None = None, head_major: bool = False, chunk: int = CHUNK,
           prepared: Prepared | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, D] (any float dtype); caches [blocks, block_size, KV, D], or with
    `head_major` [KV, blocks, block_size, D] (the attention shards' pages), fp32 or bf16, any
    strides but a contiguous D; block_tables [B, W] (entries past a row's blocks may be -1);
    kv_lens [B]: row b sees its first kv_lens[b] positions (or `prepared`, from `prepare`,
    instead of both).
    Returns (O [B, H, D] fp32, lse [B, H] fp32); a row with kv_lens 0 gets O = 0, lse = -inf."""
    lib = library()
    if lib is None:
        raise RuntimeError("the native paged decode kernel is unavailable")
    b, h, d = q.shape
    if head_major:
        kv, _, bs, _ = k_cache.shape
        sh, sb, so, _ = k_cache.stride()
    else:
        _, bs, kv, _ = k_cache.shape
        sb, so, sh, _ = k_cache.stride()
    if k_cache.stride() != v_cache.stride() or v_cache.dtype != k_cache.dtype \
            or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache and v_cache differ in dtype, shape or strides")
    if k_cache.stride(-1) != 1 or d != k_cache.shape[-1]:
        raise ValueError("the caches' head dim must be contiguous and match q's")
    if prepared is None:
        prepared = prepare(block_tables, kv_lens, bs, h, d, chunk=chunk)
    p = prepared
    scale = d ** -0.5 if scale is None else scale
    q = q.to(torch.float32).contiguous()
    o = torch.empty(b, h, d)
    lse = torch.empty(b, h)
    rc = lib.paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                          int(k_cache.dtype == torch.bfloat16), p.tables.data_ptr(),
                          p.tables.stride(0), p.lens.data_ptr(), b, h, kv, d, bs, sb, so, sh,
                          float(scale), p.chunk, p.chunks, torch.get_num_threads(),
                          p.part_acc.data_ptr(), p.part_ml.data_ptr(), o.data_ptr(),
                          lse.data_ptr())
    if rc != 0:
        raise ValueError(f"paged_decode refused shapes h={h} kv={kv} d={d}")
    return o, lse
