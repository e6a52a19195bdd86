"""KV caches on anonymous memory maps: zero, writable, and backed only where written."""
from __future__ import annotations

import gc
import os

import torch

from bench.common import rss_mb
from services.engine.kv_cache import lazy_zeros


def rss_mib() -> float:
    return rss_mb(os.getpid())


def test_lazy_zeros_is_zero_writable_and_untouched_until_written():
    gc.collect()
    before = rss_mib()
    t = lazy_zeros(4, 64, 1 << 20, dtype=torch.bfloat16)          # 512 MiB
    assert t.shape == (4, 64, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert rss_mib() - before < 64                                  # nothing resident yet
    assert not bool(t[1, 7].any()) and not bool(t[3, 63, -5:].any())
    t[2, 5].fill_(3.0)                                              # 2 MiB written
    assert bool((t[2, 5] == 3.0).all()) and not bool(t[2, 4].any())
    assert rss_mib() - before < 64
    del t
    gc.collect()


def test_lazy_zeros_of_nothing_and_other_dtypes():
    assert lazy_zeros(0, 3, dtype=torch.float32).shape == (0, 3)
    f = lazy_zeros(2, 3, dtype=torch.float32)
    f += 1.5
    assert torch.equal(f, torch.full((2, 3), 1.5))
