"""Q-first decode with the MLP pool behind real servers (gRPC, or the NCCL protocol)."""
from __future__ import annotations

import torch

from services.engine import GenerationParams

PARAMS = GenerationParams(max_tokens=10, ignore_eos=True, return_logits=True)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (7, 30, 12, 19)]


def generate_stopping_after_prefill(service, stop) -> list[list[int]]:
    """Greedy decode of `prompts()`, calling `stop()` (a replica dies) once the prefill
    step, which goes through every replica, has run."""
    for p in prompts():
        service.add_request(p, PARAMS)
    service.step()
    stop()
    while service.has_unfinished():
        service.step()
    return [service.seqs[i].output_ids for i in sorted(service.seqs)]
