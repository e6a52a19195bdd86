"""CUDA fast paths against the CPU references (skipped where no CUDA device exists)."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import naive

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("t", [1, 63, 100, 500])
def test_flash_attn_dense_matches_naive(t):
    fa = pytest.importorskip("kernels.attention.flash_attn_gpu")
    pytest.importorskip("flash_attn")
    torch.manual_seed(t)
    q = torch.randn(2, t, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, t, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, t, 2, 64, device="cuda", dtype=torch.bfloat16)
    o, lse = fa.attention_lse(q, k, v, causal=True)
    o_ref, lse_ref = naive.attention_lse(q.float(), k.float(), v.float(), causal=True)
    assert ((o.float() - o_ref).norm() / o_ref.norm()).item() < 2e-2
    assert (lse - lse_ref).abs().max().item() < 5e-2


def test_naive_attention_runs_on_cuda():
    q = torch.randn(1, 7, 4, 16, device="cuda")
    k = torch.randn(1, 7, 2, 16, device="cuda")
    o, lse = naive.attention_lse(q, k, k, causal=True)
    o_cpu, lse_cpu = naive.attention_lse(q.cpu(), k.cpu(), k.cpu(), causal=True)
    assert torch.allclose(o.cpu(), o_cpu, atol=1e-5)
