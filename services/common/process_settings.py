"""The CPU settings every serving process makes before it computes anything.

`tune_process()` keeps freed memory in the process (`allocator.py`) and flushes subnormal
floats to zero (`denormals.py`). It must run before the first parallel operation starts
PyTorch's compute threads, which inherit the flush mode only when they are created:
`splitstack`'s `main` calls it for every command, and each Ray replica first thing in its
constructor.
"""
from __future__ import annotations

from services.common.allocator import keep_freed_memory
from services.common.denormals import flush_denormals


def tune_process() -> None:
    keep_freed_memory()
    flush_denormals()
