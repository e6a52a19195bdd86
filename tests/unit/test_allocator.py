"""`keep_freed_memory`: big tensors reuse freed heap memory instead of new pages."""
from __future__ import annotations

import platform
import resource

import pytest
import torch

from services.common.allocator import keep_freed_memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc settings")


def steady_state_faults(rounds: int = 8) -> int:
    """Minor page faults of the last of `rounds` rounds of a prefill-like pattern: two
    48 MB inputs (above glibc's largest mmap threshold) and their sum, then all freed."""
    faults = 0
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        a, b = torch.ones(12 * 2**20), torch.ones(12 * 2**20)
        c = a + b
        del a, b, c
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return faults


@glibc
def test_kept_memory_is_reused_without_page_faults():
    try:
        assert keep_freed_memory(False)                 # glibc's defaults: mmap, unmap
        assert steady_state_faults() >= 12 * 2**20 * 4 // 4096     # one tensor's pages at least
        assert keep_freed_memory()
        assert steady_state_faults() < 512
    finally:
        keep_freed_memory(False)


@glibc
def test_opt_out_leaves_malloc_alone(monkeypatch):
    keep_freed_memory(False)          # (the CLI's tests may have set it in this process)
    monkeypatch.setenv("SPLITSTACK_KEEP_FREED_MEMORY", "0")
    try:
        assert not keep_freed_memory()
        assert steady_state_faults() >= 12 * 2**20 * 4 // 4096
    finally:
        keep_freed_memory(False)
