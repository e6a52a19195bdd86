"""The fused Triton chunked delta rule against the token-by-token oracle (CUDA only)."""
from __future__ import annotations

import pytest
import torch

from kernels.gated_delta import chunked
from tests.helpers.gated_delta import inputs, oracle, rel

pytestmark = pytest.mark.gpu


def cuda(xs):
    return [None if x is None else x.cuda() for x in xs]


@pytest.mark.parametrize("t", [1, 63, 100, 500])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_triton_matches_the_oracle(t, dtype, tol):
    from kernels.gated_delta import triton_chunked as tc
    xs = inputs(t, dtype=dtype, seed=t)
    o_ref, s_ref = oracle(*xs)
    o, s = tc.chunk_gated_delta_rule(*cuda(xs))
    assert o.dtype == s.dtype == torch.float32
    assert rel(o, o_ref) < tol and rel(s, s_ref) < tol


@pytest.mark.parametrize("dk, dv, hk, hv", [(64, 64, 4, 8), (48, 80, 1, 3), (128, 128, 2, 2)])
def test_triton_head_shapes_and_groups(dk, dv, hk, hv):
    from kernels.gated_delta import triton_chunked as tc
    xs = inputs(200, hk, hv, dk, dv, b=1, seed=dk)
    o_ref, s_ref = oracle(*xs)
    o, s = tc.chunk_gated_delta_rule(*cuda(xs))
    assert rel(o, o_ref) < 1e-4 and rel(s, s_ref) < 1e-4


def test_triton_state_only_sweep_and_wanted_rows():
    """No wanted row: the state alone (outputs zero); some: those chunks' rows exact, the
    others zero; a replay from a zero state matches too."""
    from kernels.gated_delta import triton_chunked as tc
    xs = inputs(300, seed=7)
    o_ref, s_ref = oracle(*xs)
    none = torch.zeros(300, dtype=torch.bool)
    o, s = tc.chunk_gated_delta_rule(*cuda(xs), out_rows=none.cuda())
    assert rel(s, s_ref) < 1e-4 and o.abs().max().item() == 0
    want = none.clone()
    want[[10, 299]] = True                     # chunks 0 and 4 of 5
    o, s = tc.chunk_gated_delta_rule(*cuda(xs), out_rows=want.cuda())
    assert rel(s, s_ref) < 1e-4
    assert rel(o[:, :64], o_ref[:, :64]) < 1e-4 and rel(o[:, 256:], o_ref[:, 256:]) < 1e-4
    assert o[:, 64:256].abs().max().item() == 0
    replay = inputs(300, seed=7, init=False)
    o_ref, s_ref = oracle(*replay)
    o, s = tc.chunk_gated_delta_rule(*cuda(replay))
    assert rel(o, o_ref) < 1e-4 and rel(s, s_ref) < 1e-4


def test_dispatch_takes_triton_on_cuda_and_matches_the_torch_form(monkeypatch):
    import kernels.gated_delta as gd
    xs = cuda(inputs(500, seed=3))
    monkeypatch.setenv(gd.KERNEL_ENV, "triton")
    o, s = gd.chunk_gated_delta_rule(*xs)
    o_t, s_t = chunked.chunk_gated_delta_rule(*xs)
    assert rel(o, o_t) < 1e-4 and rel(s, s_t) < 1e-4


def test_triton_under_a_cuda_graph_replays_new_inputs():
    """Captured once, replayed on other values of the same shape: the replay path's use."""
    from kernels.gated_delta import triton_chunked as tc
    static = cuda(inputs(256, seed=1, init=False))
    tc.chunk_gated_delta_rule(*static)                     # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tc.chunk_gated_delta_rule(*static)
    fresh = inputs(256, seed=2, init=False)
    for dst, src in zip(static, fresh):
        if dst is not None:
            dst.copy_(src)
    graph.replay()
    o_ref, s_ref = oracle(*fresh)
    assert rel(out[0], o_ref) < 1e-4 and rel(out[1], s_ref) < 1e-4
