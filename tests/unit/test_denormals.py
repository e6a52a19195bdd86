"""`flush_denormals`: subnormal floats become zero on every compute thread, and the gated
delta rule's results do not move.

Each case runs in a fresh interpreter: the flush mode is a per-thread CPU setting that the
compute threads inherit when they start, and a test process has long started its own."""
from __future__ import annotations

import platform

import pytest
import torch

from tests.fresh import run_fresh

x86_or_arm = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64", "aarch64"),
                                reason="flush-to-zero is an x86 / ARM CPU mode")

PROBE = """
import sys, torch
from services.common.process import flush_denormals
from kernels.gated_delta import chunk_gated_delta_rule
on = flush_denormals() if sys.argv[1] == "flush" else False
torch.set_num_threads(2)
x = torch.full((1 << 22,), 1e-39)            # subnormal inputs, split over both threads
y = x * 1.5
a = torch.full((64, 64), 1e-20)
b = a @ a                                    # 64 · 1e-40: subnormal results of a GEMM
g = torch.Generator().manual_seed(0)
t, h, dk, dv = 512, 4, 32, 32
q, k = torch.randn(1, t, h, dk, generator=g), torch.randn(1, t, h, dk, generator=g)
v = torch.randn(1, t, h, dv, generator=g)
decay = -3.0 * torch.rand(1, t, h, generator=g)      # strong decays: e^(γ_i − γ_j) spans
beta = torch.rand(1, t, h, generator=g)               # the subnormal range within a chunk
o, s = chunk_gated_delta_rule(q, k, v, decay, beta)
torch.save((o, s), sys.argv[2])
print(on, int((y != 0).sum()), int((b != 0).sum()))
"""


def probe(mode: str, out: str, **env: str) -> tuple[bool, int, int]:
    """(flushing on, nonzero elementwise results, nonzero GEMM results) in a fresh process."""
    res = run_fresh(PROBE, mode, out, timeout=120, **env).split()
    return res[0] == "True", int(res[1]), int(res[2])


@x86_or_arm
def test_subnormals_flush_on_every_thread_and_the_delta_rule_agrees(tmp_path):
    on, nz_y, nz_b = probe("keep", str(tmp_path / "keep.pt"))
    assert not on and nz_y == 1 << 22 and nz_b == 64 * 64       # subnormals computed
    on, nz_y, nz_b = probe("flush", str(tmp_path / "flush.pt"))
    assert on and nz_y == 0 and nz_b == 0                         # on both threads
    (o0, s0), (o1, s1) = torch.load(tmp_path / "keep.pt"), torch.load(tmp_path / "flush.pt")
    # within what separates two runs of one mode in separate processes (up to 1.5e-5
    # here, in about one run in five)
    assert (o1 - o0).norm() <= 1e-4 * o0.norm() and (s1 - s0).norm() <= 1e-4 * s0.norm()


@x86_or_arm
def test_opt_out_keeps_subnormals(tmp_path):
    on, nz_y, nz_b = probe("flush", str(tmp_path / "o.pt"), SPLITSTACK_FLUSH_DENORMALS="0")
    assert not on and nz_y == 1 << 22 and nz_b == 64 * 64


def test_tune_process_shortens_the_gil_switch_interval():
    import sys

    from services.common.process import SWITCH_INTERVAL_S, tune_process
    before = sys.getswitchinterval()
    try:
        tune_process()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        assert SWITCH_INTERVAL_S < 0.005          # below Python's default
    finally:
        sys.setswitchinterval(before)
