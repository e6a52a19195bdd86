"""RidgeFill tests' families and prompts."""
from __future__ import annotations

import torch

FAMILIES = ["qwen3", "llama3", "qwen3_next", "qwen3_5"]


def prompt(n, seed=0) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
