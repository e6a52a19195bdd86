"""Norms and feed-forward blocks shared by every family."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """nn.Linear whose few-row products (decode steps) run as `W @ xᵀ`.

    With MKL on CPU, `x @ Wᵀ` for a handful of rows runs well below memory bandwidth, while
    the same product as `W @ xᵀ` streams W row-major: about 1.6x faster at 8 rows (measured
    on the 2-core CI machine; bench/engine_vs_hf.py). Larger batches keep F.linear.
    """

    few_rows = 64

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if not 0 < rows <= self.few_rows or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        y = (self.weight @ x.reshape(rows, -1).T).T.contiguous()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], -1)


def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weightᵀ` with the same few-row strategy as `Linear` (for tied LM heads)."""
    rows = x.numel() // x.shape[-1]
    if not 0 < rows <= Linear.few_rows or x.device.type != "cpu":
        return F.linear(x, weight)
    return (weight @ x.reshape(rows, -1).T).T.contiguous().reshape(*x.shape[:-1], -1)


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
