"""The native int8 product (`kernels/linear/cpu_int8.c`) against its torch reference: every
row count its register passes split differently, output counts that leave partial tiles and
blocks, a K that is not a multiple of the group or of 4, strided and bf16 inputs, one thread
and two. The integer sums are exact, so only the float sums' order may differ."""
from __future__ import annotations

import pytest
import torch

from kernels.linear import cpu_int8


@pytest.fixture(scope="module", autouse=True)
def _built():
    if not cpu_int8.available():
        pytest.fail("the native int8 kernel did not build (a C compiler is part of setup)")


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, cpu_int8.Packed]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.linspace(0.1, 2, n)[:, None]
    q, scales = cpu_int8.quantize_rows(w)
    return q, scales, cpu_int8.pack(q, scales)


@pytest.mark.parametrize("n,k", [(64, 64), (80, 96), (200, 36), (37, 22), (960, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_reference(n, k, rows, threads):
    q, scales, packed = _weight(n, k, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    got = cpu_int8.linear(x, packed, threads=threads)
    want = cpu_int8.reference(x, q, scales)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("group", [4, 32, 64, 256])
def test_every_group_size(group):
    q, scales, packed = _weight(96, 300, seed=3)
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(4))
    want = cpu_int8.reference(x, q, scales, group=group)
    got = cpu_int8.linear(x, packed, group=group)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_bf16_in_bf16_out_and_strided_rows():
    q, scales, packed = _weight(130, 128, seed=5)
    wide = torch.randn(3, 4, 256, generator=torch.Generator().manual_seed(6)).bfloat16()
    x = wide[..., 64:192]                       # a view with row stride 256
    got = cpu_int8.linear(x, packed)
    assert got.shape == (3, 4, 130) and got.dtype == torch.bfloat16
    want = cpu_int8.reference(x, q, scales)
    assert torch.equal(got, want.bfloat16()) or \
        (got.float() - want).abs().max().item() <= 2 ** -8 * want.abs().max().item()


def test_zero_rows_and_zero_groups():
    q, scales, packed = _weight(48, 64, seed=7)
    assert cpu_int8.linear(torch.empty(0, 64), packed).shape == (0, 48)
    x = torch.zeros(2, 64)
    x[1, 40:] = torch.randn(24)                 # row 0 all zero; row 1 a zero first group
    got = cpu_int8.linear(x, packed)
    assert torch.equal(got[0], torch.zeros(48))
    want = cpu_int8.reference(x, q, scales)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_the_quantized_product_stays_near_the_float_one():
    """Int8 weights and activations: the error a user sees, on realistic magnitudes."""
    q, scales, packed = _weight(256, 576, seed=8)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(9))
    exact = x @ (q.float() * scales[:, None]).T
    rel = (cpu_int8.linear(x, packed) - exact).norm() / exact.norm()
    assert 0 < rel.item() < 0.01


def test_refuses_what_does_not_fit():
    _, _, packed = _weight(32, 64, seed=10)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_int8.linear(torch.randn(2, 63), packed)
    with pytest.raises(ValueError, match="refused"):
        cpu_int8.linear(torch.randn(2, 64), packed, group=6)


def test_consolidated_weights_give_the_same_products():
    """`consolidate` copies packed weights into one 2 MB-aligned buffer, in order, each on
    its own 4 KB boundary: the same products."""
    weights = [_weight(n, k, seed=n) for n, k in [(64, 64), (200, 36), (37, 22)]]
    moved = cpu_int8.consolidate([p for _, _, p in weights])
    starts = [m.data.data_ptr() for m in moved]
    assert starts[0] % cpu_int8.HUGE_PAGE == 0 and all(a % 4096 == 0 for a in starts)
    assert starts == sorted(starts)
    for (_, _, packed), m in zip(weights, moved):
        assert m.data.data_ptr() != packed.data.data_ptr() and torch.equal(m.data, packed.data)
        x = torch.randn(3, packed.in_features)
        assert torch.equal(cpu_int8.linear(x, m), cpu_int8.linear(x, packed))
