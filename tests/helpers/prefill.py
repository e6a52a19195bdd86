"""The attention service decoding prompts prefilled by a prefill replica."""
from __future__ import annotations

import torch

from services.attention.runner import qfirst_engine
from services.deployment.transports import make_transport
from services.engine import GenerationParams
from services.mlp_pool import MLPPool

PARAMS = GenerationParams(max_tokens=8, ignore_eos=True, return_logits=True)


def prompts(lengths=(7, 30, 12, 19), seed=3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in lengths]


def attention(model, num_shards=2):
    """An attention service over an in-process MLP pool (64 blocks of 4 tokens)."""
    return qfirst_engine(model, make_transport("local", [MLPPool(model, "pool-0")]),
                         num_shards=num_shards, block_size=4, num_blocks=64)


def no_leaks(*engines) -> None:
    """Every block back in each engine (the prefill replica's, the attention service's)."""
    for engine in engines:
        engine.blocks.check()
        assert engine.blocks.num_free == engine.blocks.num_blocks
