"""The native batched paged decode kernel against the naive reference, in both cache layouts,
and the torch fallback it replaces."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import cpu_flash, cpu_paged, naive


def scattered_cache(b, lens, kv, d, dtype, *, block_size=16, seed=0):
    """Caches with every sequence's blocks at random ids (no two adjacent on purpose)."""
    g = torch.Generator().manual_seed(seed)
    width = max(1, -(-max(lens) // block_size))
    blocks = b * width * 2 + 3
    k = torch.randn(blocks, block_size, kv, d, generator=g).to(dtype)
    v = torch.randn(blocks, block_size, kv, d, generator=g).to(dtype)
    ids = torch.randperm(blocks, generator=g)[:b * width].view(b, width).clone()
    for row, n in enumerate(lens):               # entries past a row's blocks: -1
        ids[row, -(-n // block_size):] = -1
    return k, v, ids, torch.tensor(lens)


def test_kernel_builds_here():
    # CI and the serving images have a C compiler; the fallback is tested below by forcing it
    assert cpu_paged.available(), "no native kernel: check cc/gcc"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,kv,d", [(9, 3, 64), (8, 8, 32), (16, 2, 128), (6, 2, 40)])
@pytest.mark.parametrize("chunk", [16, 256])
def test_decode_matches_naive(dtype, h, kv, d, chunk):
    lens = [1, 37, 300, 16, 0, 129]               # one key, block edges, several chunks, none
    k, v, tables, kv_lens = scattered_cache(len(lens), lens, kv, d, dtype, seed=h + d)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(1))
    o, lse = cpu_paged.decode(q.to(dtype), k, v, tables, kv_lens, chunk=chunk)
    o_ref, lse_ref = naive.paged_attention_lse(q.to(dtype)[:, None], k, v, tables, kv_lens)
    assert o.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(o, o_ref[:, 0], rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse, lse_ref[:, 0], rtol=1e-5, atol=2e-6)
    assert torch.isneginf(lse[4]).all() and (o[4] == 0).all()     # the empty row


def test_head_major_layout_matches_naive():
    lens = [150, 37, 512]
    k, v, tables, kv_lens = scattered_cache(3, lens, 3, 64, torch.float32, seed=3)
    q = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(2))
    o, lse = cpu_paged.decode(q, k.permute(2, 0, 1, 3).contiguous(),
                              v.permute(2, 0, 1, 3).contiguous(), tables, kv_lens,
                              head_major=True)
    o_ref, lse_ref = naive.paged_attention_lse(q[:, None], k, v, tables, kv_lens)
    torch.testing.assert_close(o, o_ref[:, 0], rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse, lse_ref[:, 0], rtol=1e-5, atol=2e-6)


def test_custom_scale_and_strided_pages():
    lens = [40, 70]
    k, v, tables, kv_lens = scattered_cache(2, lens, 2, 64, torch.float32, seed=4)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(5))
    # every other block of a bigger cache: strided in the block dim, D still contiguous
    k2, v2 = torch.zeros(2 * k.shape[0], *k.shape[1:]), torch.zeros(2 * v.shape[0], *v.shape[1:])
    k2[::2], v2[::2] = k, v
    o, lse = cpu_paged.decode(q, k2[::2], v2[::2], tables, kv_lens, scale=0.3)
    o_ref, lse_ref = naive.paged_attention_lse(q[:, None], k, v, tables, kv_lens, scale=0.3)
    torch.testing.assert_close(o, o_ref[:, 0], rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse, lse_ref[:, 0], rtol=1e-5, atol=2e-6)


def test_bad_inputs_are_refused():
    k, v, tables, kv_lens = scattered_cache(1, [20], 2, 64, torch.float32)
    q = torch.randn(1, 4, 64)
    with pytest.raises(ValueError, match="exceeds"):
        cpu_paged.decode(q, k, v, tables, torch.tensor([10_000]))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_paged.decode(q[..., :32], k[..., ::2], v[..., ::2], tables, kv_lens)
    with pytest.raises(ValueError, match="differ"):
        cpu_paged.decode(q, k, v.to(torch.bfloat16), tables, kv_lens)
    with pytest.raises(ValueError, match="chunk"):
        cpu_paged.decode(q, k, v, tables, kv_lens, chunk=4096)


@pytest.mark.parametrize("native", [True, False])
def test_run_paged_decode_with_and_without_the_kernel(native, monkeypatch):
    if not native:
        monkeypatch.setattr(cpu_paged, "_lib", None)        # as on a machine without cc
    lens = [33, 200, 5, 64]
    k, v, tables, kv_lens = scattered_cache(4, lens, 3, 64, torch.float32, seed=7)
    q = torch.randn(4, 1, 9, 64, generator=torch.Generator().manual_seed(8))
    plan = cpu_flash.plan_paged(tables, kv_lens, 16, 1)
    o, lse = cpu_flash.run_paged(q, k, v, plan)
    assert (plan.native is not None) == native       # which path ran
    o_ref, lse_ref = naive.paged_attention_lse(q, k, v, tables, kv_lens)
    torch.testing.assert_close(o.float(), o_ref, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=2e-6)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setattr(cpu_paged, "_lib", False)
    monkeypatch.setenv("SPLITSTACK_NATIVE_KERNELS", "0")
    assert not cpu_paged.available()
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_paged.decode(torch.randn(1, 2, 8), torch.zeros(1, 16, 1, 8), torch.zeros(1, 16, 1, 8),
                         torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))


def test_build_is_cached_per_source(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSTACK_KERNEL_CACHE", str(tmp_path))
    first = cpu_paged.build()
    assert first.parent == tmp_path / "kernels" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert cpu_paged.build() == first and first.stat().st_mtime_ns == stamp   # not rebuilt
    changed = tmp_path / "cpu_paged.c"
    changed.write_text(cpu_paged.SOURCE.read_text() + "\n/* edited */\n")
    monkeypatch.setattr(cpu_paged, "SOURCE", changed)
    assert cpu_paged.build() != first                                         # a new key
