"""Keep freed memory in the process (glibc malloc), so big activations are not faulted in
page by page on every prefill.

PyTorch's CPU allocator hands each tensor to malloc and frees it straight back. glibc serves
any block above its mmap threshold (32 MB at most) with a fresh `mmap` and unmaps it on
free, and trims the heap's free top above 128 KB. A 16K-token prefill of the bench hybrid
allocates many such blocks per layer, and every page of each is zeroed by the kernel on
first touch again: 2.3 million minor faults per exact prefill, 1.4 million per RidgeFill
prefill. The fill's many short-lived inputs (filled rows' K/V or GDN inputs, the merged
sequence) make it pay proportionally more than exact.

`keep_freed_memory()` turns both off (`M_MMAP_MAX` 0: every block comes from the heap;
`M_TRIM_THRESHOLD` 2 GiB: freed memory is kept for reuse), which is what vLLM's CPU
backend gets from preloading tcmalloc. Cost: the process keeps its peak resident size.
Every `splitstack` command, the Ray replicas and `bench/ridgefill_ttft.py` call it;
`SPLITSTACK_KEEP_FREED_MEMORY=0` leaves malloc as it is.
"""
from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1            # the largest value mallopt takes (an int)
DEFAULTS = {M_MMAP_MAX: 65536, M_TRIM_THRESHOLD: 128 * 1024}


def _libc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_freed_memory(enable: bool = True) -> bool:
    """Serve every allocation from the heap and keep what is freed (`enable`), or restore
    glibc's defaults. Returns whether the settings were applied: False off glibc, or when
    `SPLITSTACK_KEEP_FREED_MEMORY=0` and `enable`."""
    if enable and os.environ.get("SPLITSTACK_KEEP_FREED_MEMORY", "1") == "0":
        return False
    libc = _libc()
    if libc is None:
        return False
    settings = ({M_MMAP_MAX: 0, M_TRIM_THRESHOLD: TRIM_THRESHOLD} if enable else DEFAULTS)
    ok = all(libc.mallopt(param, value) == 1 for param, value in settings.items())
    if not enable:
        libc.malloc_trim(0)           # hand the kept memory back
    return ok
