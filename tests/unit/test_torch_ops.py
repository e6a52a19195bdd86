"""The native kernels as torch operators (`kernels.torch_ops`): each operator gives exactly
what its Python path gives (`cpu_int8.linear`; `models.layers.project` on a bf16 weight; the
cache write and `cpu_paged.decode`), writes only the real rows, refuses what it cannot take
with a clear error, and forgets a released table."""
from __future__ import annotations

import pytest
import torch

from kernels import torch_ops
from kernels.attention import cpu_paged
from kernels.linear import cpu_int8
from models import layers
from kernels.torch_ops import WeightEntry

BS, KV, D, H = 16, 3, 64, 9


@pytest.fixture(scope="module", autouse=True)
def built():
    if not torch_ops.available():
        pytest.fail("the native torch operators did not build (a C++ compiler is part of setup)")


@pytest.fixture
def step():
    """A registered table (two int8 weights, a weight with neither copy, two bf16 weights on
    oneDNN's packed copy, one with a bias), and a step of three sequences over a scattered
    cache; cleared afterwards."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(96, 576, generator=gen), torch.randn(200, 130, generator=gen)]
    packs = [cpu_int8.pack(*cpu_int8.quantize_rows(w)) for w in weights]
    bf16 = [torch.randn(80, 64, generator=gen).bfloat16() for _ in range(2)]
    bias = torch.randn(80, generator=gen).bfloat16()
    packed = [layers.onednn_bf16(w) for w in bf16]
    entries = [WeightEntry(576, 96, packs[0]), WeightEntry(130, 200, packs[1]),
               WeightEntry(576, 96)]
    if packed[0] is not None:                 # oneDNN takes bf16 products here
        entries += [WeightEntry(64, 80, bf16=packed[0]),
                    WeightEntry(64, 80, bf16=packed[1], bias=bias)]
    table = torch_ops.weight_table(entries)
    tables = torch.randperm(40, generator=gen)[:18].reshape(3, 6)
    lens = torch.tensor([70, 3, 96])
    prepared = cpu_paged.prepare(tables, lens, BS, H, D, chunk=32)
    yield dict(packs=packs, bf16=bf16, bias=bias, onednn=packed[0] is not None, table=table,
               tables=tables, lens=lens, prepared=prepared, gen=gen)
    torch_ops.clear_step()
    torch_ops.release_table(table)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_int8_linear_is_the_python_product(step, dtype, rows):
    torch_ops.set_step(step["table"], step["prepared"], 3)
    for key, pack in enumerate(step["packs"]):
        x = torch.randn(rows, pack.in_features, generator=step["gen"]).to(dtype)
        got = torch.ops.splitstack_cpu.int8_linear(x, key, pack.out_features)
        assert got.dtype == dtype and got.shape == (rows, pack.out_features)
        assert torch.equal(got, cpu_int8.linear(x, pack))


def test_int8_linear_takes_strided_rows(step):
    torch_ops.set_step(step["table"], step["prepared"], 3)
    pack = step["packs"][0]
    wide = torch.randn(4, 2 * pack.in_features, generator=step["gen"])
    x = wide[:, ::2]                                     # column stride 2
    got = torch.ops.splitstack_cpu.int8_linear(x, 0, pack.out_features)
    assert torch.equal(got, cpu_int8.linear(x.contiguous(), pack))


def test_int8_linear_refusals(step):
    x = torch.randn(2, 576)
    with pytest.raises(RuntimeError, match="no weight 0 in this step"):
        torch.ops.splitstack_cpu.int8_linear(x, 0, 96)       # no step set
    torch_ops.set_step(step["table"], step["prepared"], 3)
    with pytest.raises(RuntimeError, match="weight 2 has no native int8 copy"):
        torch.ops.splitstack_cpu.int8_linear(x, 2, 96)
    with pytest.raises(RuntimeError, match="no weight 9"):
        torch.ops.splitstack_cpu.int8_linear(x, 9, 96)
    with pytest.raises(RuntimeError, match="does not fit weight 1"):
        torch.ops.splitstack_cpu.int8_linear(x, 1, 200)      # K 576 against 130
    with pytest.raises(RuntimeError, match="does not fit weight 0"):
        torch.ops.splitstack_cpu.int8_linear(x, 0, 95)       # out_features


@pytest.mark.parametrize("rows", [1, 8])
def test_bf16_linear_is_project(step, rows):
    """oneDNN's packed product, with and without a bias, as `project` runs it."""
    if not step["onednn"]:
        pytest.skip("oneDNN has no bf16 products on this CPU")   # not on the CI machine
    torch_ops.set_step(step["table"], step["prepared"], 3)
    x = torch.randn(rows, 64, generator=step["gen"]).bfloat16()
    for key, bias in ((3, None), (4, step["bias"])):
        got = torch.ops.splitstack_cpu.bf16_linear(x, key, 80)
        assert torch.equal(got, layers.project(x, step["bf16"][key - 3], bias))
    with pytest.raises(RuntimeError, match="weight 0 has no packed bf16 copy"):
        torch.ops.splitstack_cpu.bf16_linear(x, 0, 96)
    with pytest.raises(RuntimeError, match="does not fit weight 3"):
        torch.ops.splitstack_cpu.bf16_linear(x.float(), 3, 80)


def test_a_released_table_is_gone(step):
    table = torch_ops.weight_table([WeightEntry(576, 96, step["packs"][0])])
    torch_ops.release_table(table)
    with pytest.raises(RuntimeError, match=f"no weight table {table}"):
        torch_ops.set_step(table, step["prepared"], 3)


def _rows(lens, tables, gen, kv_dtype):
    b = lens.shape[0]
    q = torch.randn(b, H, D, generator=gen)
    k = torch.randn(b, KV, D, generator=gen).to(kv_dtype)
    v = torch.randn(b, KV, D, generator=gen).to(kv_dtype)
    pos = lens - 1
    slots = tables[torch.arange(b), pos // BS] * BS + pos % BS
    return q, k, v, slots


@pytest.mark.parametrize("cache_dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.float32),
                                                  (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("rows", [3, 2])
def test_paged_decode_is_the_write_and_the_kernel(step, cache_dtype, kv_dtype, rows):
    """The first `rows` rows' k, v land at their slots (a padding row writes nothing), and
    O is `cpu_paged.decode` over the written cache, bit for bit."""
    gen = step["gen"]
    kv = torch.randn(2, 4, 40, BS, KV, D, generator=gen).to(cache_dtype)
    q, k, v, slots = _rows(step["lens"], step["tables"], gen, kv_dtype)
    expected = kv.clone()
    for side, new in ((0, k), (1, v)):
        expected[side, 2].view(-1, KV, D)[slots[:rows]] = new[:rows].to(cache_dtype)
    torch_ops.set_step(step["table"], step["prepared"], rows)
    got = torch.ops.splitstack_cpu.paged_decode(q, k, v, kv, 2, slots, D ** -0.5)
    assert torch.equal(kv, expected)
    ref, _ = cpu_paged.decode(q, expected[0, 2], expected[1, 2], prepared=step["prepared"])
    assert got.dtype == torch.float32 and torch.equal(got, ref)


def test_paged_decode_converts_a_bf16_query(step):
    gen = step["gen"]
    kv = torch.randn(2, 1, 40, BS, KV, D, generator=gen).to(torch.bfloat16)
    q, k, v, slots = _rows(step["lens"], step["tables"], gen, torch.bfloat16)
    torch_ops.set_step(step["table"], step["prepared"], 3)
    got = torch.ops.splitstack_cpu.paged_decode(q.bfloat16(), k, v, kv, 0, slots, 0.1)
    ref, _ = cpu_paged.decode(q.bfloat16(), kv[0, 0], kv[1, 0], prepared=step["prepared"],
                              scale=0.1)
    assert torch.equal(got, ref)


def test_paged_decode_refusals(step):
    gen = step["gen"]
    kv = torch.zeros(2, 2, 40, BS, KV, D)
    q, k, v, slots = _rows(step["lens"], step["tables"], gen, torch.float32)
    with pytest.raises(RuntimeError, match="no step is set"):
        torch.ops.splitstack_cpu.paged_decode(q, k, v, kv, 0, slots, 0.1)
    torch_ops.set_step(step["table"], step["prepared"], 3)
    with pytest.raises(RuntimeError, match=r"kv must be \[2, layers"):
        torch.ops.splitstack_cpu.paged_decode(q, k, v, kv, 2, slots, 0.1)    # layer 2 of 2
    with pytest.raises(RuntimeError, match="tables are for 3 rows, q has 2"):
        torch.ops.splitstack_cpu.paged_decode(q[:2], k, v, kv, 0, slots, 0.1)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.splitstack_cpu.paged_decode(q, k, v, kv, 0, slots + 40 * BS, 0.1)
    with pytest.raises(RuntimeError, match="do not fit the cache"):
        torch.ops.splitstack_cpu.paged_decode(q, k[:, :2], v, kv, 0, slots, 0.1)
    with pytest.raises(RuntimeError, match="not supported"):
        torch.ops.splitstack_cpu.paged_decode(q, k.half(), v.half(), kv, 0, slots, 0.1)
