"""Int8 x int8 products for decode-sized batches on the CPU (AVX512-VNNI).

`linear(x, packed)` is `x @ Wᵀ` for a weight quantized per output row (`quantize_rows`,
int8 with fp32 scales) and packed once (`pack`), with x quantized on the fly per row and per
group of `GROUP` columns (dynamic symmetric int8, as llama.cpp's Q8_0 activations). The
integer sums are exact, so `reference` (the same math in torch) is its test oracle up to the
float sums' order. `cpu_int8.c` holds the kernel; without AVX512-VNNI it runs the same math
in plain C, and without a compiler `available()` is False and callers keep torch's product.
"""
from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from kernels import native

SOURCE = Path(__file__).with_name("cpu_int8.c")
GROUP = 32          # activation columns per scale (Q8_0's block)
MAX_ROWS = 1 << 24  # the C file's limit on rows per call
MAX_K = 16384

_lib: ctypes.CDLL | None | bool = False      # False: not tried yet; None: unavailable
_local = threading.local()                   # each thread's scratch (ctypes drops the GIL)


def _scratch(nbytes: int) -> int:
    """The address of this thread's scratch of at least `nbytes` (kept between calls)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.buf = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
    return buf.data_ptr()


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.int8_linear.argtypes = [ptr, i, i64, i, i, ptr, ptr, i, i, ptr, i, i, ptr, ptr, ptr]
    lib.int8_linear.restype = i


def library() -> ctypes.CDLL | None:
    global _lib
    if _lib is False:
        _lib = native.load(SOURCE, _declare)
    return _lib


def available() -> bool:
    return library() is not None


@functools.cache
def vnni() -> bool:
    """Whether the kernel runs on VNNI here (otherwise its plain-C loop: correct, slow)."""
    return "avx512_vnni" in native.cpu_flags()


class Packed(NamedTuple):
    """A weight in the kernel's layout: `data` [blocks, ceil(K/4), 4, 16, 4] uint8 (blocks
    of 64 output rows; wq + 128, so padding rows and columns hold 128, i.e. zero), `scales`
    [blocks * 64] fp32."""
    data: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q [N, K] int8, scales [N] fp32), each row's largest
    magnitude mapped to 127."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def pack(q: torch.Tensor, scales: torch.Tensor) -> Packed:
    """The kernel's layout of an int8 weight q [N, K] with per-row scales [N]."""
    n, k = q.shape
    if k > MAX_K:
        raise ValueError(f"in_features {k} > {MAX_K}")
    blocks, k4 = -(-n // 64), -(-k // 4)
    full = torch.zeros(blocks * 64, k4 * 4, dtype=torch.int16)
    full[:n, :k] = q.to(torch.int16)
    data = (full + 128).to(torch.uint8).reshape(blocks, 4, 16, k4, 4).permute(0, 3, 1, 2, 4)
    s = torch.zeros(blocks * 64)
    s[:n] = scales.float()
    return Packed(data.contiguous(), s, n, k)


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def _huge_page_buffer(nbytes: int) -> torch.Tensor:
    """An untouched uint8 buffer of `nbytes` starting on a 2 MB boundary, advised for
    transparent huge pages (Linux; elsewhere, or where the advice fails, a plain buffer).
    The advice comes before the first write, so the pages fault in 2 MB at a time."""
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    buf = raw[start:start + nbytes]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(buf.data_ptr(), -(-nbytes // HUGE_PAGE) * HUGE_PAGE, MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass
    return buf


def consolidate(packs: list[Packed]) -> list[Packed]:
    """The same weights copied into one buffer on huge pages, in the given order (the order
    a decode step reads them), each 4 KB-aligned. A product then streams its weight without
    a TLB miss and a restarted hardware prefetch at every 4 KB page
    (`bench/serving/decode_compile.py --product-rows`: "int8 native" against "int8 native apart")."""
    align = 4096
    sizes = [-(-p.data.numel() // align) * align for p in packs]
    buf = _huge_page_buffer(max(sum(sizes), 1))
    out, offset = [], 0
    for p, size in zip(packs, sizes):
        view = buf[offset:offset + p.data.numel()].view(p.data.shape)
        view.copy_(p.data)
        out.append(p._replace(data=view))
        offset += size
    return out


def linear(x: torch.Tensor, packed: Packed, *, group: int = GROUP,
           threads: int | None = None) -> torch.Tensor:
    """`x @ Wᵀ` for x [..., K] fp32 or bf16 with at most MAX_ROWS rows; the result has x's
    dtype."""
    lib = library()
    if lib is None:
        raise RuntimeError("the native int8 product is unavailable")
    k = packed.in_features
    if x.shape[-1] != k or x.dtype not in (torch.float32, torch.bfloat16) or not x.is_cpu:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit a weight of in_features {k}")
    rows = x if x.dim() == 2 else x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, packed.out_features, dtype=x.dtype)
    if m == 0:
        return y.reshape(*x.shape[:-1], packed.out_features)
    k4, ng = -(-k // 4), -(-k // group)
    xq_bytes = (m * k4 * 4 + 63) // 64 * 64          # the row sums' floats start aligned
    base = _scratch(xq_bytes + 4 * (m * ng + m))
    bf16 = int(x.dtype == torch.bfloat16)
    rc = lib.int8_linear(rows.data_ptr(), bf16, rows.stride(0), m, k, packed.data.data_ptr(),
                         packed.scales.data_ptr(), packed.out_features, group, y.data_ptr(), bf16,
                         threads or torch.get_num_threads(), base, base + xq_bytes,
                         base + xq_bytes + 4 * m * ng)
    if rc != 0:
        raise ValueError(f"int8_linear refused rows={m} k={k} group={group}")
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], packed.out_features)


def quantize_activations(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch: (xq [M, K] fp32 integers, xs [M, G])."""
    x = x.reshape(-1, x.shape[-1]).float()
    m, k = x.shape
    ng = -(-k // group)
    padded = torch.zeros(m, ng * group)
    padded[:, :k] = x
    g = padded.reshape(m, ng, group)
    amax = g.abs().amax(dim=2)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(g * inv[..., None])             # half to even, as the C file's rounding
    return xq.clamp(-127, 127).reshape(m, -1)[:, :k], amax / 127.0


def reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
              group: int = GROUP) -> torch.Tensor:
    """`linear`'s math in torch (float64 sums), fp32 [..., N]: the kernel's oracle."""
    xq, xs = quantize_activations(x, group)
    m, k = xq.shape
    ng = xs.shape[1]
    padded = torch.zeros(m, ng * group, dtype=torch.float64)
    padded[:, :k] = xq.double()
    wq = torch.zeros(q.shape[0], ng * group, dtype=torch.float64)
    wq[:, :k] = q.double()
    sums = torch.einsum("mgk,ngk->mng", padded.reshape(m, ng, group),
                        wq.reshape(-1, ng, group))
    y = (sums * xs.double()[:, None, :]).sum(-1) * scales.double()[None, :]
    return y.float().reshape(*x.shape[:-1], -1)
