"""The Triton delta-rule kernel's launch shapes, chunk bookkeeping and dispatch, on the CPU
(the kernels themselves: tests/unit/test_kernels_triton_gpu.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.gated_delta as gd
from kernels.gated_delta import chunked, triton_chunked as tc


def test_plan_for_the_bench_hybrid_shape():
    p = tc.plan((1, 16384, 4, 64), (1, 16384, 4, 64), (1, 16384, 8, 64), torch.float32)
    assert (p.chunk, p.n_chunks, p.padded_t, p.group) == (64, 256, 16384, 2)
    # 8 heads: value blocks of 16 columns give the state sweep 32 programs instead of 8
    assert (p.block_k, p.block_v, p.v_blocks, p.num_warps) == (64, 16, 4, 4)
    assert p.wy_grid == (256, 8) and p.state_grid == (8, 4)
    assert p.output_grid(3) == (3, 8, 4)
    assert p.precision == "ieee"
    assert p.state_bytes() == 8 * 256 * 64 * 64 * 4


def test_plan_pads_the_last_chunk_and_odd_head_dims():
    p = tc.plan((2, 100, 2, 48), (2, 100, 2, 48), (2, 100, 6, 80), torch.bfloat16)
    assert (p.n_chunks, p.padded_t) == (2, 128)           # rows [100, 128) are padding
    assert (p.block_k, p.block_v, p.v_blocks) == (64, 16, 5)   # 80 columns in five blocks
    assert p.precision == "tf32" and p.group == 3
    wide = tc.plan((1, 1, 1, 256), (1, 1, 1, 256), (1, 1, 1, 256), torch.float16)
    assert (wide.block_k, wide.block_v, wide.v_blocks, wide.num_warps) == (256, 16, 16, 4)
    many = tc.plan((4, 64, 16, 128), (4, 64, 16, 128), (4, 64, 32, 128), torch.bfloat16)
    assert (many.block_k, many.block_v, many.v_blocks, many.num_warps) == (128, 32, 4, 4)
    tiny = tc.plan((1, 5, 1, 4), (1, 5, 1, 4), (1, 5, 1, 3), torch.float32, chunk_size=16)
    assert (tiny.block_k, tiny.block_v, tiny.n_chunks) == (16, 16, 1)  # tl.dot needs >= 16


@pytest.mark.parametrize("shapes, dtype, chunk, name", [
    (((1, 8, 2, 32),) * 2 + ((1, 8, 3, 32),), torch.float32, 64, "value heads"),
    (((1, 8, 2, 512),) * 2 + ((1, 8, 2, 32),), torch.float32, 64, "Dk"),
    (((1, 8, 2, 32),) * 2 + ((1, 8, 2, 300),), torch.float32, 64, "Dv"),
    (((1, 8, 2, 32),) * 2 + ((1, 8, 2, 32),), torch.float64, 64, "dtype"),
    (((1, 8, 2, 32),) * 2 + ((1, 8, 2, 32),), torch.float32, 48, "chunk_size"),
    (((1, 8, 2, 32), (1, 8, 2, 16), (1, 8, 2, 32)), torch.float32, 64, "q/k shape"),
    (((1, 8, 2, 32),) * 2 + ((1, 9, 2, 32),), torch.float32, 64, "v shape"),
    (((1, 0, 2, 32),) * 3, torch.float32, 64, "B, T"),
])
def test_plan_refuses_what_the_kernels_do_not_take(shapes, dtype, chunk, name):
    with pytest.raises(tc.TritonPlanError) as e:
        tc.plan(*shapes, dtype, chunk)
    assert e.value.name == name


def test_wanted_chunks():
    assert tc.wanted_chunks(None, 130, 64) == [0, 1, 2]
    rows = torch.zeros(130, dtype=torch.bool)
    assert tc.wanted_chunks(rows, 130, 64) == []          # a state-only sweep
    rows[[5, 129]] = True
    assert tc.wanted_chunks(rows, 130, 64) == [0, 2]
    with pytest.raises(tc.TritonPlanError):
        tc.wanted_chunks(rows[:-1], 130, 64)


def test_chunk_gamma_is_the_in_chunk_cumsum_flat_over_padding():
    torch.manual_seed(0)
    g = -F.softplus(torch.randn(2, 100, 3))
    p = tc.plan((2, 100, 3, 16), (2, 100, 3, 16), (2, 100, 3, 16), torch.float32)
    gam = tc.chunk_gamma(g, p)                                     # [B·HV, 128]
    assert gam.shape == (6, 128) and gam.dtype == torch.float32
    for b in range(2):
        for h in range(3):
            row = gam[b * 3 + h]
            assert torch.allclose(row[:64], g[b, :64, h].double().cumsum(0).float())
            assert torch.allclose(row[64:100], g[b, 64:, h].double().cumsum(0).float())
            assert torch.equal(row[100:], row[99].expand(28))    # γ_C = last real row's


def test_dispatch_keeps_the_torch_form_off_cuda(monkeypatch):
    """On the CPU the env setting changes nothing: bitwise the torch chunked form."""
    torch.manual_seed(1)
    q, k = torch.randn(1, 70, 2, 16), torch.randn(1, 70, 2, 16)
    v, beta = torch.randn(1, 70, 4, 16), torch.rand(1, 70, 4)
    g = -F.softplus(torch.randn(1, 70, 4))
    monkeypatch.setenv(gd.KERNEL_ENV, "triton")
    assert gd.kernel_choice() == "triton" and not tc.supported(q, k, v)
    o, s = gd.chunk_gated_delta_rule(q, k, v, g, beta)
    o_ref, s_ref = chunked.chunk_gated_delta_rule(q, k, v, g, beta)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


def test_kernel_choice_names_a_bad_setting(monkeypatch):
    monkeypatch.delenv(gd.KERNEL_ENV, raising=False)
    assert gd.kernel_choice() == "torch"
    monkeypatch.setenv(gd.KERNEL_ENV, "cuda")
    with pytest.raises(ValueError, match="SPLITSTACK_GDN_KERNEL.*'cuda'"):
        gd.kernel_choice()
