"""Tail-Replay's evaluation arms (seed 001): a prompt's first N − tail tokens are a cache hit.

    tailreplay      FA KV reused exactly; each group's GDN states rebuilt by replaying the
                    last ceil(r·m) cached FA output hiddens from zero (r: `replay_ratio`,
                    default 0.1; `tailreplay-5` / `tailreplay-10` fix r = 5% / 10%)
    zero-only       FA KV reused, GDN states zero, no replay (the paper's baseline)

The uncached suffix (the eval's scored tail) is then prefilled exactly. Dense models reuse
the KV exactly, so every arm equals `exact` there. Built from the same functions the engine
uses (`services/prefix_cache/replay.py`).
"""
from __future__ import annotations

import torch

from evals.arms import Arm, register_arm
from evals.ridgefill_arms import greedy_from_prefill
from models.model import CausalLM
from services.prefill.ridgefill import PrefillResult
from services.prefix_cache.replay import (check_ratio, continue_prefill, prompt_rows,
                                          replay_len, tail_replay)


class ReplayArm(Arm):
    ratio: float | None = None       # fixed by the registered subclasses

    def __init__(self, model: CausalLM, *, tail: int = 256, replay_ratio: float = 0.1,
                 **options):
        super().__init__(model, **options)
        self.tail = tail
        self.r = check_ratio(self.ratio if self.ratio is not None else replay_ratio)

    @torch.inference_mode()
    def _run(self, ids: list[int]):
        ids_t = torch.tensor(ids)
        m = len(ids) - self.tail
        kv, hidden = prompt_rows(self.model, ids_t[:m])
        k = replay_len(m, self.r, self.model.config.linear_conv_kernel_dim or 1)
        states = tail_replay(self.model, ids_t[m - k:m],
                             hidden[:, m - k:m] if hidden is not None else None)
        return continue_prefill(self.model, ids_t, kv, states, return_cache=True)

    def tail_logits(self, ids: list[int], tail_len: int) -> torch.Tensor:
        logits, _, _ = self._run(ids)
        return logits[-tail_len:]

    def complete(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs = []
        for ids in prompts:
            logits, cache, states = self._run(ids)
            lin = self.model.config.linear_attention_layers
            res = PrefillResult(
                {l: kv[0] for l, kv in cache.items()}, {l: kv[1] for l, kv in cache.items()},
                {l: torch.ones(len(ids), dtype=torch.bool) for l in cache},
                {l: states.conv[i] for i, l in enumerate(lin)},
                {l: states.recurrent[i] for i, l in enumerate(lin)}, logits=logits[-1:])
            outs.append(greedy_from_prefill(self.model, res, len(ids), max_tokens))
        return outs


register_arm("tailreplay")(ReplayArm)
register_arm("tailreplay-5")(type("TailReplay5", (ReplayArm,), {"ratio": 0.05}))
register_arm("tailreplay-10")(type("TailReplay10", (ReplayArm,), {"ratio": 0.10}))
register_arm("zero-only")(type("ZeroOnly", (ReplayArm,), {"ratio": 0.0}))
