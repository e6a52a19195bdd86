"""Arms: pluggable prefill strategies compared by the harness.

An arm answers two questions about a prompt: the logits it yields at the last `tail_len`
positions (for losses and agreement), and its greedy completion (for retrieval). `exact` is
the reference; RidgeFill and Tail-Replay register their own arms with `register_arm`, and
`evals.catalog.make_arm` builds any of them by name.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from models.model import CausalLM
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.engine.kv_cache import CacheStorage

ARMS: dict[str, type["Arm"]] = {}


def register_arm(name: str):
    def wrap(cls):
        cls.name = name
        ARMS[name] = cls
        return cls
    return wrap


class Arm(ABC):
    name = "arm"

    def __init__(self, model: CausalLM, **options):
        self.model = model
        self.options = options

    @abstractmethod
    def tail_logits(self, ids: list[int], tail_len: int) -> torch.Tensor:
        """Logits [tail_len, V] at the prompt's last `tail_len` positions."""

    @abstractmethod
    def complete(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy completions of each prompt (no EOS stop: the caller trims)."""


@register_arm("exact")
class ExactArm(Arm):
    """The exact model: full forward for logits, the exact engine for completions."""

    def __init__(self, model: CausalLM, **options):
        super().__init__(model, **options)
        # the default 256 MiB cache holds 5.8K tokens of SmolLM2: let it hold at least one
        # item at the model's full context (longer items then run fewer at a time)
        cfg, block = model.config, 16
        per_block = CacheStorage.bytes_per_block(cfg, block, model.dtype)
        full = per_block * -(-cfg.max_position_embeddings // block)
        self.engine = LLMEngine(model, EngineConfig(
            block_size=block, kv_cache_bytes=max(256 << 20, full), max_num_batched_tokens=4096,
            max_prefill_chunk=4096, max_num_seqs=8))
        self._cache: dict[tuple, torch.Tensor] = {}

    def clear_cache(self) -> None:
        self._cache.clear()

    @torch.inference_mode()
    def tail_logits(self, ids: list[int], tail_len: int) -> torch.Tensor:
        """Memoised: every arm is scored against the same exact logits."""
        key = (tuple(ids), tail_len)
        if key not in self._cache:
            self._cache[key] = self.model.forward(torch.tensor([ids]), last_n=tail_len)[0].float()
        return self._cache[key]

    def complete(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = GenerationParams(max_tokens=max_tokens, ignore_eos=True)
        return [s.output_ids for s in self.engine.generate(prompts, params)]
