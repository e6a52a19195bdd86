"""Norms and feed-forward blocks shared by every family."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


PACK_MIN_ELEMENTS = 2 << 20   # fp32 weights of 8 MB and up: one-row products run packed
_MKL = torch.backends.mkl.is_available()


def _packed_single_row(weight: torch.Tensor) -> torch.Tensor:
    """MKL's packed copy of an fp32 `weight` for one-row products, built on first use.

    A one-row `x @ Wᵀ` against an LM head that does not fit in cache runs as a single-core
    GEMV, about half memory bandwidth; the packed product streams it on every core (1.9x on
    a 67 MB head, 2 cores; bench/linear_products.py). The copy costs the weight's size once.
    It is rebuilt when the weight changes in place (`_version`), so training code that edits
    weights between calls never reads a stale copy (inference tensors have no version
    counter: one edited in place under `torch.inference_mode` is not seen).
    """
    version = -1 if weight.is_inference() else weight._version
    cached = getattr(weight, "_splitstack_packed", None)
    if cached is None or cached[0] != version:
        with torch.no_grad():
            cached = (version, torch.ops.mkl._mkl_reorder_linear_weight(weight, 1))
        weight._splitstack_packed = cached
    return cached[1]


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            few_rows: int = 64) -> torch.Tensor:
    """`x @ weightᵀ (+ bias)`, choosing the CPU product by row count (`Linear`, tied heads).

    With MKL on CPU, `x @ Wᵀ` for a handful of rows runs well below memory bandwidth, while
    the same product as `W @ xᵀ` streams W row-major: 1.6-3x faster at 8 rows (measured per
    shape by bench/linear_products.py). One row (a batch-1 decode step) is a GEMV: plain
    `F.linear`, or the packed product for an fp32 weight bigger than the caches (the LM
    head). Larger batches and other devices keep F.linear. This runs for every projection
    of a decode step, so the checks are ordered cheapest first.
    """
    if not x.is_cpu:
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    if rows == 1:
        if weight.numel() < PACK_MIN_ELEMENTS or not _MKL or weight.dtype != torch.float32 \
                or (weight.requires_grad and torch.is_grad_enabled()):
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
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


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
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
