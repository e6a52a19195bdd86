"""Norms and feed-forward blocks shared by every family."""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels.linear import cpu_int8


PACK_MIN_ELEMENTS = 2 << 20   # fp32 weights of 8 MB and up: one-row products run packed
_MKL = torch.backends.mkl.is_available()


def _bf16_packing() -> bool:
    """Whether oneDNN takes bf16 linears here (a CPU with AVX512-BF16 / AMX, or its emulation
    on AVX512): then bf16 products run on a weight packed in oneDNN's blocked layout."""
    try:
        return bool(torch.backends.mkldnn.is_available()
                    and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


_ONEDNN_BF16 = _bf16_packing()


def _cached(weight: torch.Tensor, attr: str, pack) -> torch.Tensor:
    """`pack(weight)`, built on first use and kept on the weight. It is rebuilt when the
    weight changes in place (`_version`), so training code that edits weights between calls
    never reads a stale copy (inference tensors have no version counter: one edited in place
    under `torch.inference_mode` is not seen). The copy costs the weight's size once."""
    version = -1 if weight.is_inference() else weight._version
    cached = getattr(weight, attr, None)
    if cached is None or cached[0] != version:
        with torch.no_grad():
            cached = (version, pack(weight))
        setattr(weight, attr, cached)
    return cached[1]


def _packed_single_row(weight: torch.Tensor) -> torch.Tensor:
    """MKL's packed copy of an fp32 `weight` for one-row products.

    A one-row `x @ Wᵀ` against an LM head that does not fit in cache runs as a single-core
    GEMV, about half memory bandwidth; the packed product streams it on every core (1.9x on
    a 67 MB head, 2 cores; bench/serving/linear_products.py)."""
    return _cached(weight, "_splitstack_packed",
                   lambda w: torch.ops.mkl._mkl_reorder_linear_weight(w, 1))


def _packed_bf16(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a bf16 `weight`: every row count runs faster on it than on
    the plain layout (1.5-2x for 1-16 rows, 1.1-1.3x for a 512-row prompt; exact, the same
    sums; bench/serving/linear_products.py)."""
    return _cached(weight, "_splitstack_onednn",
                   lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 1))


INT8_MAX_ROWS = 4      # torch's int8 product: up to this many rows (past it bf16 wins)
INT8_NATIVE_MAX_ROWS = 16   # the VNNI kernel's: up to this many rows (past it bf16 wins)
QUANT_ATTR = "_splitstack_quant"
INT8_ATTR = "_splitstack_int8"      # (version, Int8Weight), as `_cached` keeps it


def mark_int8(weight: torch.Tensor, *, prompts: bool = False) -> None:
    """Let the decode-sized products of `weight` run on its int8 copy (`int8_copy`): up to
    INT8_NATIVE_MAX_ROWS rows on the native VNNI kernel, INT8_MAX_ROWS on torch's product,
    where each beats bf16 (`bench/serving/decode_compile.py --product-rows`). Larger products (prompts)
    keep the weight itself. `prompts`: every product (what `splitstack eval --quantization
    int8` scores)."""
    setattr(weight, QUANT_ATTR, math.inf if prompts else -1)


class Int8Weight(NamedTuple):
    """A weight's int8 copy: per-row int8 values and scales for torch's weight-only product
    (`q`, `scales` in the weight's dtype), or, where the native kernel runs (AVX512-VNNI),
    the same values in its packed layout (`packed`) alone."""
    q: torch.Tensor | None
    scales: torch.Tensor | None
    packed: cpu_int8.Packed | None


@functools.cache
def _native_int8() -> bool:
    return cpu_int8.vnni() and cpu_int8.available()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q [N, K] int8, scales [N] in weight's dtype) with
    weight ~= q * scales[:, None], each row's largest magnitude mapped to 127."""
    q, scales = cpu_int8.quantize_rows(weight)
    return q, scales.to(weight.dtype)


def _int8_weight(weight: torch.Tensor) -> Int8Weight:
    if _native_int8():
        return Int8Weight(None, None, cpu_int8.pack(*cpu_int8.quantize_rows(weight)))
    return Int8Weight(*quantize_int8(weight), None)


def int8_copy(weight: torch.Tensor) -> Int8Weight:
    """The weight's `Int8Weight`, built on first use and kept on the weight (`_cached`)."""
    return _cached(weight, INT8_ATTR, _int8_weight)


def native_int8_rows(weight: torch.Tensor) -> int:
    """Up to how many rows `project` runs `weight` on its native int8 copy (0: never; the
    copy is built here if it was not yet), for callers that call the kernel themselves
    (`kernels.torch_ops` in compiled decode steps)."""
    marked = getattr(weight, QUANT_ATTR, 0)
    if not marked or not _native_int8():
        return 0
    if int8_copy(weight).packed is None:
        return 0
    return int(min(marked, cpu_int8.MAX_ROWS)) if marked > 0 else INT8_NATIVE_MAX_ROWS


def onednn_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy `project` multiplies a bf16 `weight` by (built here if it was
    not yet), or None where its bf16 products take another path (no oneDNN bf16 here, or
    not a bf16 weight): for callers that call the product themselves
    (`kernels.torch_ops`)."""
    if not _ONEDNN_BF16 or weight.dtype != torch.bfloat16 or not weight.is_cpu \
            or weight.numel() == 0:
        return None
    return _packed_bf16(weight)


def consolidate_int8(weights: list[torch.Tensor]) -> None:
    """Move the native int8 copies of `weights` (already built; given in the order a decode
    step reads them) into one buffer on huge pages (`cpu_int8.consolidate`). Torch's copies,
    where the CPU has no VNNI, stay as they are."""
    native = [(w, getattr(w, INT8_ATTR, None)) for w in weights]
    native = [(w, c) for w, c in native if c is not None and c[1].packed is not None]
    if not native:
        return
    moved = cpu_int8.consolidate([copy.packed for _, (_, copy) in native])
    for (w, (version, copy)), packed in zip(native, moved):
        setattr(w, INT8_ATTR, (version, copy._replace(packed=packed)))


def _int8_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  marked: float) -> torch.Tensor | None:
    """`project` on the int8 copy, or None where this product keeps the weight."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or x.dtype != weight.dtype:
        return None
    native = _native_int8()
    limit = marked if marked > 0 else (INT8_NATIVE_MAX_ROWS if native else INT8_MAX_ROWS)
    if rows > limit:
        return None
    copy = int8_copy(weight)
    if copy.packed is not None:
        y = cpu_int8.linear(x, copy.packed)
    else:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(rows, -1).contiguous(), copy.q,
                                               copy.scales).reshape(*x.shape[:-1], -1)
    return y if bias is None else y + bias


def row_bucket(m: int) -> int:
    """The row count a bf16 product of m rows runs at: m itself up to 16 (decode batches),
    then the next multiple of 32, from 512 rows the next multiple of 256. oneDNN builds and
    caches a primitive per shape; unbucketed, every new prompt length added one per weight
    and a server's memory grew by about 200 MB over its first minute under varied prompts."""
    if m <= 16:
        return m
    step = 32 if m <= 512 else 256
    return -(-m // step) * step


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            few_rows: int = 64) -> torch.Tensor:
    """`x @ weightᵀ (+ bias)`, choosing the CPU product by dtype and row count (`Linear`,
    tied heads).

    A weight marked int8 (`mark_int8`, `--quantization int8`) runs its decode-sized products
    on its int8 copy: on a CPU with AVX512-VNNI, `kernels.linear.cpu_int8` (int8 weights
    times activations quantized per row and 32-column group, as llama.cpp's Q8_0 path),
    elsewhere torch's weight-only product (`aten._weight_int8pack_mm`, activations in the
    weight's dtype). Larger products keep the weight itself, where int8 loses
    (`bench/serving/decode_compile.py --product-rows`).

    bf16 (the CPU serving dtype): oneDNN's product on a packed copy of the weight, any row
    count. fp32 with MKL: for a handful of rows `x @ Wᵀ` runs well below memory bandwidth,
    while the same product as `W @ xᵀ` streams W row-major: 1.6-3x faster at 8 rows
    (measured per shape by bench/serving/linear_products.py). One row (a batch-1 decode step) is a
    GEMV: plain `F.linear`, or the packed product for an fp32 weight bigger than the caches
    (the LM head). Larger batches, other devices and recorded gradients keep F.linear. This
    runs for every projection of a decode step, so the checks are ordered cheapest first.
    """
    if not x.is_cpu or (weight.requires_grad and torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    marked = getattr(weight, QUANT_ATTR, 0)
    if marked:
        y = _int8_product(x, weight, bias, marked)
        if y is not None:
            return y
    if weight.dtype == torch.bfloat16:
        if not _ONEDNN_BF16 or x.dtype != torch.bfloat16 or x.numel() == 0:
            return F.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        m = rows.shape[0]
        bucket = row_bucket(m)
        if bucket != m:         # a row count oneDNN has a primitive for: pad with zero rows
            rows = torch.cat([rows, rows.new_zeros(bucket - m, rows.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), _packed_bf16(weight), bias,
                                               "none", [], "")
        return (y if bucket == m else y[:m]).reshape(*x.shape[:-1], -1)
    rows = x.numel() // x.shape[-1]
    if rows == 1:
        if weight.numel() < PACK_MIN_ELEMENTS or not _MKL or weight.dtype != torch.float32:
            return F.linear(x, weight, bias)
        y = torch.ops.mkl._mkl_linear(x.reshape(1, -1).contiguous(), _packed_single_row(weight),
                                      weight, bias, 1)
        return y.reshape(*x.shape[:-1], -1)
    if rows == 0 or rows > few_rows:
        return F.linear(x, weight, bias)
    y = (weight @ x.reshape(rows, -1).T).T.contiguous()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], -1)


class Fused(NamedTuple):
    """Several projections of one input stored as row blocks of one matrix."""
    weight: torch.Tensor          # [sum of out features, in]
    bias: torch.Tensor | None
    sizes: tuple[int, ...]        # out features of each projection, in order
    rest: tuple[torch.Tensor, torch.Tensor | None]   # the rows after the first projection's
                                  # (k and v of q/k/v), one stable view: packed copies stick
    params: tuple[nn.Parameter, ...]   # each module's weight, as made here


def fuse_linears(*mods: nn.Linear) -> Fused:
    """Concatenate the weights (and biases) of `mods` into one matrix and make each module's
    weight a view of its rows, so one product serves them all and the modules keep working
    (and loading, and training) on their own."""
    weight = torch.cat([m.weight.detach() for m in mods])
    has_bias = all(m.bias is not None for m in mods)
    bias = torch.cat([m.bias.detach() for m in mods]) if has_bias else None
    row = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row:row + n], requires_grad=m.weight.requires_grad)
        if has_bias:
            m.bias = nn.Parameter(bias[row:row + n], requires_grad=m.bias.requires_grad)
        row += n
    first = mods[0].weight.shape[0]
    rest = (weight[first:], None if bias is None else bias[first:])
    return Fused(weight, bias, tuple(m.weight.shape[0] for m in mods), rest,
                 tuple(m.weight for m in mods))


def still_fused(fused: Fused | None, *mods: nn.Module) -> Fused | None:
    """`fused` while every module's weight is still its view (no module swapped for another,
    no dtype or device change since) and no gradient is being recorded; else None, and the
    caller runs the modules one by one."""
    if fused is None or torch.is_grad_enabled():
        return None
    for m, p in zip(mods, fused.params):
        if m is None or m._parameters.get("weight") is not p:   # swapped, dropped or copied
            return None
    first = fused.params[0]       # `.to()` / `.cuda()` move every parameter's data
    if first.data_ptr() != fused.weight.data_ptr() or first.dtype != fused.weight.dtype:
        return None
    return fused


class Linear(nn.Linear):
    """nn.Linear whose few-row products (decode steps) take `project`'s CPU strategy."""

    few_rows = 64

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.few_rows)


class RMSNorm(nn.Module):
    """RMSNorm. `zero_centered` (Qwen3-Next/3.5) scales by (1 + w), computed in fp32;
    otherwise (Llama, Qwen3) the fp32-normalised value is cast back before scaling by w."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:
            return F.rms_norm(x.float(), x.shape[-1:], 1.0 + self.weight.float(),
                              self.eps).to(x.dtype)
        if x.dtype == torch.float32:     # the fused kernel; same math as the cast path below
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        # x · rsqrt(mean(x²) + eps) in fp32 (the fused kernel, unweighted), cast, then · w
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], None, self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Gated DeltaNet output norm over Dv: w · norm(o) · silu(z) (plain w, init 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        of = o.float()
        y = self.weight * (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)).to(o.dtype)
        return (y * F.silu(z.float())).to(o.dtype)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); after `fuse()`, gate and up run as one product."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.gate_up: Fused | None = None

    def fuse(self) -> None:
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = still_fused(self.gate_up, self.gate_proj, self.up_proj)
        if fused is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = project(x, fused.weight, fused.bias).split(fused.sizes, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """Top-k routed experts plus a sigmoid-gated shared expert (Qwen3-Next / Qwen3.5-MoE).

    Experts are stacked: `experts_gate_up [E, 2·Im, h]` (gate rows first) and
    `experts_down [E, h, Im]`; the loader stacks per-expert checkpoint tensors.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, moe_intermediate: int,
                 shared_intermediate: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = Linear(hidden, num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * moe_intermediate, hidden))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden, moe_intermediate))
        self.shared_expert = MLP(hidden, shared_intermediate) if shared_intermediate else None
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if shared_intermediate else None
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)          # [N, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            rows, slot = (experts == e).nonzero(as_tuple=True)
            gate, up = (x[rows] @ self.experts_gate_up[e].T).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.experts_down[e].T
            out.index_add_(0, rows, y * weights[rows, slot, None])
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)
