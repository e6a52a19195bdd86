"""Attention-with-lse backends, chosen through a small registry with lazy imports.

Contract (see `naive.py`): `attention_lse(q, k, v, *, kv_lens, q_start, causal, scale)` and
`paged_attention_lse(q, k_cache, v_cache, block_tables, kv_lens, q_start, *, causal, scale)`
both return `(O [B, Tq, H, D], lse [B, Tq, H] fp32)`. For many layers over the same
cache, `plan_paged(...)` once per step and `run_paged(q, k_cache, v_cache, plan)` per layer. GPU-only modules are imported only when
selected, so CPU machines never import them.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

BACKENDS = {
    "naive": "kernels.attention.naive",
    "cpu_flash": "kernels.attention.cpu_flash",
    "flash_attn": "kernels.attention.flash_attn_gpu",
}


def get_backend(name: str | None = None, device: str | torch.device = "cpu") -> ModuleType:
    """Return the backend module `name`, or the fastest one available for `device`."""
    if name is None:
        if torch.device(device).type == "cuda":
            name = "flash_attn" if _has_flash_attn() else "naive"
        else:
            name = "cpu_flash"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])


def _has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None
