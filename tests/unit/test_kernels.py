"""Every fast kernel against its readable reference, at odd lengths."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import cpu_flash, get_backend, naive
from kernels.conv import causal_conv1d, causal_conv1d_ref
from kernels.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
from kernels.merge import combine_current, merge, merge_many

LENGTHS = [1, 63, 100, 500]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


@pytest.mark.parametrize("t", LENGTHS)
def test_cpu_flash_matches_naive_dense(t):
    torch.manual_seed(t)
    q, k, v = torch.randn(2, t, 8, 32), torch.randn(2, t, 2, 32), torch.randn(2, t, 2, 32)
    o_ref, lse_ref = naive.attention_lse(q, k, v, causal=True)
    o, lse = cpu_flash.attention_lse(q, k, v, causal=True)
    assert rel(o, o_ref) < 1e-5 and (lse - lse_ref).abs().max() < 1e-4


def test_naive_attention_equals_softmax_definition():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 4)
    o, lse = naive.attention_lse(q, k, v, causal=True)
    s = torch.einsum("qhd,khd->hqk", q[0], k[0]) / 2.0
    s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    assert torch.allclose(o[0], torch.einsum("hqk,khd->qhd", s.softmax(-1), v[0]), atol=1e-6)
    assert torch.allclose(lse[0], torch.logsumexp(s, -1).T, atol=1e-6)


@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("backend", ["naive", "cpu_flash"])
def test_paged_matches_dense(t, backend):
    """Random block tables with padding; queries are the last rows of each sequence."""
    torch.manual_seed(t)
    bs, nblocks, kvh, d = 16, 96, 2, 32
    lens = torch.tensor([t, max(1, t // 2 + 3)])
    tq = min(5, int(lens.min()))
    perm = torch.randperm(nblocks)
    width = -(-int(lens.max()) // bs)
    tables = torch.full((2, width), -1)
    k_cache, v_cache = torch.randn(nblocks, bs, kvh, d), torch.randn(nblocks, bs, kvh, d)
    q = torch.randn(2, tq, 4, d)
    used = 0
    for b in range(2):
        nb = -(-int(lens[b]) // bs)
        tables[b, :nb] = perm[used:used + nb]
        used += nb
    o, lse = get_backend(backend).paged_attention_lse(q, k_cache, v_cache, tables, lens)
    for b in range(2):
        n = int(lens[b])
        k = k_cache[tables[b, :-(-n // bs)]].reshape(-1, kvh, d)[:n]
        v = v_cache[tables[b, :-(-n // bs)]].reshape(-1, kvh, d)[:n]
        o_ref, lse_ref = naive.attention_lse(q[b:b + 1], k[None], v[None], causal=True)
        assert rel(o[b], o_ref[0]) < 1e-5
        assert (lse[b] - lse_ref[0]).abs().max() < 1e-4


def test_merge_of_random_splits_equals_single_sweep():
    torch.manual_seed(0)
    t, h, d = 257, 4, 16
    q, k, v = torch.randn(1, 1, h, d), torch.randn(1, t, h, d), torch.randn(1, t, h, d)
    o_full, lse_full = naive.attention_lse(q, k, v, causal=False)
    for trial in range(200):
        owner = torch.randint(0, 4, (t,))
        parts = []
        for s in torch.randperm(4).tolist():             # merge in any order
            idx = (owner == s).nonzero()[:, 0]
            if len(idx) == 0:                            # an empty shard: lse = -inf, O = NaN
                parts.append((torch.full((1, 1, h, d), float("nan")),
                              torch.full((1, 1, h), float("-inf"))))
            else:
                parts.append(naive.attention_lse(q, k[:, idx], v[:, idx], causal=False))
        o, lse = merge_many(parts)
        assert (o - o_full).abs().max() <= 1e-6, trial
        assert (lse - lse_full).abs().max() <= 1e-5, trial


def test_merge_with_empty_shards_only():
    o, lse = merge(torch.full((2, 3), float("nan")), torch.full((2,), float("-inf")),
                   torch.full((2, 3), float("nan")), torch.full((2,), float("-inf")))
    assert torch.isneginf(lse).all()


@pytest.mark.parametrize("magnitude", [800.0, -800.0])
def test_combine_current_is_finite_at_extreme_logits(magnitude):
    """lse_prev and s_jj of ±800 overflow exp() in fp32; the sigmoid form must not."""
    h, d = 2, 4
    q = torch.ones(1, h, d)
    k = torch.full((1, 1, d), magnitude * 2 / d)          # s_jj = q·k / sqrt(d) = ±800
    v = torch.randn(1, 1, d)
    o_prev = torch.randn(1, h, d)
    for lse_prev in (magnitude, magnitude - 3.0, -magnitude):
        lp = torch.full((1, h), lse_prev)
        o, lse = combine_current(o_prev, lp, q, k, v)
        assert torch.isfinite(o).all() and torch.isfinite(lse).all()
        s = torch.tensor(magnitude)
        w = 1 / (1 + torch.exp(torch.tensor(lse_prev, dtype=torch.float64) - s.double()))
        expect = (w * v[0, 0].double() + (1 - w) * o_prev[0].double()).float()
        assert torch.allclose(o[0], expect, atol=1e-5)
        assert torch.allclose(lse, torch.logaddexp(lp, s.expand(1, h)), atol=1e-3)


def test_combine_with_empty_cache_returns_current_value():
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    o, _ = combine_current(torch.full((3, 4, 8), float("nan")), torch.full((3, 4), float("-inf")),
                           q, k, v)
    assert torch.equal(o, v.repeat_interleave(2, dim=1))


def test_combine_equals_full_attention():
    torch.manual_seed(3)
    t, h, kvh, d = 40, 4, 2, 16
    q, k, v = torch.randn(1, 1, h, d), torch.randn(1, t, kvh, d), torch.randn(1, t, kvh, d)
    o_prev, lse_prev = naive.attention_lse(q, k[:, :-1], v[:, :-1], causal=False)
    o, lse = combine_current(o_prev[0], lse_prev[0], q[0], k[0, -1:], v[0, -1:])
    o_ref, lse_ref = naive.attention_lse(q, k, v, causal=False)
    assert (o - o_ref[0]).abs().max() < 1e-6 and (lse - lse_ref[0]).abs().max() < 1e-5


def gdn_inputs(t, b=2, h=4, dk=16, dv=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, t, h, dk, generator=g), torch.randn(b, t, h, dk, generator=g)
    v = torch.randn(b, t, h, dv, generator=g)
    decay = -torch.nn.functional.softplus(torch.randn(b, t, h, generator=g) * 3)
    beta = torch.rand(b, t, h, generator=g)
    return q, k, v, decay, beta


@pytest.mark.parametrize("t", LENGTHS)
def test_chunked_delta_rule_matches_recurrent(t):
    q, k, v, g, beta = gdn_inputs(t, seed=t)
    s0 = torch.randn(2, 4, 16, 24) * 0.3
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    assert rel(o, o_ref) < 1e-5 and rel(s, s_ref) < 1e-5


@pytest.mark.parametrize("t,blocks", [(300, 1), (300, 2), (1100, None)])
def test_chunked_delta_rule_across_blocks(t, blocks):
    """The chunk-parallel part runs a block of chunks at a time: block edges (and a last
    block shorter than the rest) change nothing, with and without skipped outputs."""
    q, k, v, g, beta = gdn_inputs(t, seed=t)
    s0 = torch.randn(2, 4, 16, 24) * 0.3
    kw = {} if blocks is None else {"block_chunks": blocks}
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0, **kw)
    assert rel(o, o_ref) < 1e-5 and rel(s, s_ref) < 1e-5
    want = torch.zeros(t, dtype=torch.bool)
    want[[3, t // 2]] = True
    o2, s2 = chunk_gated_delta_rule(q, k, v, g, beta, s0, out_rows=want, **kw)
    assert rel(s2, s_ref) < 1e-5        # blocks without outputs fold their chunks (below)
    assert rel(o2[:, want], o_ref[:, want]) < 1e-5


@pytest.mark.parametrize("grouped", [False, True])
def test_chunked_delta_rule_state_only_blocks(grouped):
    """Blocks with no wanted output advance the state by one affine map per chunk
    (S <- M S + N). With a weak decay the first rows still shape the final state, so a wrong
    fold shows; the state matches the token-by-token rule, and so do the outputs of the
    wanted rows after those blocks, from an initial state and with grouped key heads."""
    t = 1500
    q, k, v, g, beta = gdn_inputs(t, h=4, seed=7)
    g, beta = g * 1e-3, beta * 0.05                       # a long memory
    if grouped:
        q, k = q[:, :, ::2].contiguous(), k[:, :, ::2].contiguous()
    s0 = torch.randn(2, 4, 16, 24) * 0.3
    rep = 2 if grouped else 1
    o_ref, s_ref = recurrent_gated_delta_rule(q.repeat_interleave(rep, 2),
                                              k.repeat_interleave(rep, 2), v, g, beta, s0)
    want = torch.zeros(t, dtype=torch.bool)
    want[-40:] = True
    for blocks in (1, 3, None):
        kw = {} if blocks is None else {"block_chunks": blocks}
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0, out_rows=want, **kw)
        assert rel(s, s_ref) < 1e-5
        assert rel(o[:, want], o_ref[:, want]) < 1e-5 and not o[:, :t - 64 * 8].any()
    # the first rows matter to the final state: dropping them changes it
    _, s_late = recurrent_gated_delta_rule(q[:, 64:].repeat_interleave(rep, 2),
                                           k[:, 64:].repeat_interleave(rep, 2),
                                           v[:, 64:], g[:, 64:], beta[:, 64:], s0)
    assert rel(s_late, s_ref) > 1e-2


def test_chunked_delta_rule_grouped_key_heads():
    """q, k with fewer heads than v: each key head serves HV/HK consecutive value heads,
    as if repeated with `repeat_interleave` before the call."""
    q, k, v, g, beta = gdn_inputs(200, h=4)
    qg, kg = q[:, :, ::2].contiguous(), k[:, :, ::2].contiguous()       # 2 key heads
    o_ref, s_ref = recurrent_gated_delta_rule(qg.repeat_interleave(2, dim=2),
                                              kg.repeat_interleave(2, dim=2), v, g, beta)
    o, s = chunk_gated_delta_rule(qg, kg, v, g, beta)
    assert rel(o, o_ref) < 1e-5 and rel(s, s_ref) < 1e-5


@pytest.mark.parametrize("l2", [True, False])
def test_chunked_delta_rule_leaves_its_inputs_alone(l2):
    """One head, one batch row: the chunk-major views can alias the inputs."""
    q, k, v, g, beta = gdn_inputs(64, b=1, h=1)
    before = [x.clone() for x in (q, k, v, g, beta)]
    chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=l2)
    assert all(torch.equal(x, y) for x, y in zip((q, k, v, g, beta), before))


def test_chunked_delta_rule_gradients_match_recurrent():
    """Distillation (`derive hybrid`) trains through the chunked kernel: under autograd it
    runs out of place and its gradients are the token-by-token rule's, across blocks and
    with grouped key heads."""
    q, k, v, g, beta = (x.double() for x in gdn_inputs(150, h=4))
    qg, kg = q[:, :, ::2].contiguous(), k[:, :, ::2].contiguous()
    s0 = torch.randn(2, 4, 16, 24, dtype=torch.float64) * 0.3
    grads = []
    for fn, rep in ((chunk_gated_delta_rule, 1), (recurrent_gated_delta_rule, 2)):
        xs = [x.clone().requires_grad_() for x in (qg, kg, v, g, beta, s0)]
        a, b_ = xs[0], xs[1]
        if rep > 1:
            a, b_ = a.repeat_interleave(rep, dim=2), b_.repeat_interleave(rep, dim=2)
        kw = {"block_chunks": 1} if fn is chunk_gated_delta_rule else {}
        o, s = fn(a, b_, *xs[2:5], xs[5], **kw)
        (o.sin().sum() + s.cos().sum()).backward()
        grads.append([x.grad for x in xs])
    for got, ref in zip(*grads):
        assert rel(got, ref) < 1e-8


def test_delta_rule_state_carries_across_calls():
    q, k, v, g, beta = gdn_inputs(150)
    o_all, s_all = chunk_gated_delta_rule(q, k, v, g, beta)
    o1, s1 = chunk_gated_delta_rule(*(x[:, :70] for x in (q, k, v, g, beta)))
    o2, s2 = recurrent_gated_delta_rule(*(x[:, 70:71] for x in (q, k, v, g, beta)), s1)
    o3, s3 = chunk_gated_delta_rule(*(x[:, 71:] for x in (q, k, v, g, beta)), s2)
    assert rel(torch.cat([o1, o2, o3], 1), o_all) < 1e-5 and rel(s3, s_all) < 1e-5


def test_chunked_delta_rule_skips_unwanted_outputs_only():
    q, k, v, g, beta = gdn_inputs(300)
    o_all, s_all = chunk_gated_delta_rule(q, k, v, g, beta)
    want = torch.zeros(300, dtype=torch.bool)
    want[[5, 250]] = True
    want[280:] = True
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, out_rows=want)
    assert torch.equal(s, s_all)                        # the state is untouched
    kept = torch.zeros(300, dtype=torch.bool)
    for c0 in range(0, 300, 64):
        kept[c0:c0 + 64] = want[c0:c0 + 64].any()
    assert torch.equal(o[:, kept], o_all[:, kept]) and not o[:, ~kept].any()


def test_delta_rule_single_step_definition():
    """One step from a zero state: S = β k vᵀ after l2-normalising k, o = Sᵀ q·scale."""
    q, k, v, g, beta = gdn_inputs(1, b=1, h=1, dk=4, dv=3)
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta)
    kn = k[0, 0, 0] / k[0, 0, 0].norm()
    qn = q[0, 0, 0] / q[0, 0, 0].norm() * 4 ** -0.5
    expect_s = beta[0, 0, 0] * torch.outer(kn, v[0, 0, 0])
    assert torch.allclose(s[0, 0], expect_s, atol=1e-5)
    assert torch.allclose(o[0, 0, 0], expect_s.T @ qn, atol=1e-5)


@pytest.mark.parametrize("t", LENGTHS)
def test_conv_fast_matches_reference_with_state(t):
    torch.manual_seed(t)
    x, w = torch.randn(2, t, 12), torch.randn(12, 4)
    state = torch.randn(2, 12, 3)
    y_ref, s_ref = causal_conv1d_ref(x, w, state)
    y, s = causal_conv1d(x, w, state)
    assert (y - y_ref).abs().max() < 1e-5 and torch.equal(s, s_ref)


def test_conv_state_carry_equals_one_pass():
    torch.manual_seed(0)
    x, w = torch.randn(1, 20, 6), torch.randn(6, 4)
    y_all, s_all = causal_conv1d_ref(x, w)
    y1, s1 = causal_conv1d(x[:, :7], w)
    y2, s2 = causal_conv1d(x[:, 7:8], w, s1)
    y3, s3 = causal_conv1d(x[:, 8:], w, s2)
    assert torch.allclose(torch.cat([y1, y2, y3], 1), y_all, atol=1e-5)
    assert torch.equal(s3, s_all) and torch.equal(s_all, x[:, -3:].transpose(1, 2))


def test_cpu_flash_accepts_strided_inputs():
    """Inputs laid out [heads, D, T] in memory (a transposed W @ xᵀ projection) give the
    same O; the fused kernel alone gets these wrong."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(h, 32, 5).permute(2, 0, 1)[None] for h in (4, 2, 2))
    assert q.stride(-1) != 1 and k.stride(-1) != 1
    o, _ = cpu_flash.attention_lse(q, k, v)
    o_ref, _ = naive.attention_lse(q, k, v)
    assert rel(o, o_ref) < 1e-5


def test_conv_fast_path_equals_hf_grouped_conv1d():
    """The time-major fast path computes what HF's grouped conv1d does (same dtype)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 37, 24, generator=gen)
    w = torch.randn(24, 4, generator=gen)
    state = torch.randn(2, 24, 3, generator=gen)
    xp = torch.cat([state, x.transpose(1, 2)], dim=2)
    want = F.silu(F.conv1d(xp, w.view(24, 1, 4), groups=24)).transpose(1, 2)
    y, s = causal_conv1d(x, w, state)
    assert y.is_contiguous() and (y - want).abs().max().item() <= 1e-6
    assert torch.equal(s, xp[:, :, -3:])
