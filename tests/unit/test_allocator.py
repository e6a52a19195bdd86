"""`keep_freed_memory`: big tensors reuse freed heap memory instead of new pages.

Each case runs in a fresh interpreter: whether glibc's defaults fault depends on what the
heap already holds, and a test process's heap holds whatever earlier tests left."""
from __future__ import annotations

import platform

import pytest

from tests.fresh import run_fresh

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc settings")

PROBE = """
import resource, sys, torch
from services.common.process import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
faults = 0
for _ in range(8):      # a prefill-like round: two 48 MB inputs (above glibc's largest mmap
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt     # threshold), their sum
    a, b = torch.ones(12 * 2**20), torch.ones(12 * 2**20)
    c = a + b
    del a, b, c
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(applied, faults)
"""
ONE_TENSOR_PAGES = 12 * 2**20 * 4 // 4096


def last_round(mode: str, **env: str) -> tuple[bool, int]:
    """(settings applied, minor page faults of the last of 8 rounds) in a fresh process."""
    out = run_fresh(PROBE, mode, timeout=120, **env).split()
    return out[0] == "True", int(out[1])


@glibc
def test_kept_memory_is_reused_without_page_faults():
    applied, faults = last_round("default")
    assert not applied and faults >= ONE_TENSOR_PAGES      # glibc maps and unmaps each time
    applied, faults = last_round("keep")
    assert applied and faults < 512


@glibc
def test_opt_out_leaves_malloc_alone():
    applied, faults = last_round("keep", SPLITSTACK_KEEP_FREED_MEMORY="0")
    assert not applied and faults >= ONE_TENSOR_PAGES
