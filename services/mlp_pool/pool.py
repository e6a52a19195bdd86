"""The stateless MLP pool of the Q-First protocol (seed 003, §4; docs/design/qfirst.md).

One call per stage. Stage l takes the cache side's residual `u` (the input of layer l−1's
feed-forward; token ids for stage 0) and returns

    z = u + M_{l−1}(N2 u)                       (stage 0: z = embed(ids))
    full-attention layer l:   k, v = Wk N1(z), Wv N1(z)    (QK-norm + rotary on k)
    linear-attention layer l: the GDN input projections of N1(z)

and stage L returns sampled tokens from `final(z)`; `score` returns, for prompt rows, the
log-probs of the tokens that follow them. The pool keeps no request state, so any
replica can serve any call and a failed call can be retried elsewhere. Rows from many
requests and shards arrive batched in one call.
"""
from __future__ import annotations

import torch

from kernels.sampling import SamplingParams, sample, score_rows
from models.config import FULL_ATTENTION
from models.model import CausalLM
from services.common.messages import StageOutput


class MLPPool:
    """Holds embeddings, every MLP, Wk/Wv (+ k-norm), GDN input projections, final norm and
    LM head. (In-process it shares the model object with the cache side; each uses only its
    own stages.)"""

    def __init__(self, model: CausalLM, name: str = "pool-0"):
        self.model = model
        self.name = name
        self.calls = 0

    @torch.inference_mode()
    def stage(self, layer: int, u: torch.Tensor, positions: torch.Tensor) -> StageOutput:
        """u: [N] token ids for layer 0, else [N, h] (input of layer−1's feed-forward)."""
        self.calls += 1
        m = self.model
        z = m.embed(u) if layer == 0 else m.mlp(layer - 1, u)
        xn = m.norm_in(layer, z)
        if m.layer(layer).kind == FULL_ATTENTION:
            k, v = m.attn_key_value(layer, xn, positions)
            return StageOutput(z, k, v)
        return StageOutput(z, gdn=m.layer(layer).linear_attn.inputs(xn))

    @torch.inference_mode()
    def final(self, u: torch.Tensor, params: list[SamplingParams],
              generators: list[torch.Generator | None], histories: list | None = None):
        """u [N, h] (input of the last feed-forward) -> (tokens [N], logprobs [N], logits).
        `histories`: each row's request tokens, (prompt, output), for its penalties."""
        self.calls += 1
        m = self.model
        logits = m.final(m.mlp(m.config.num_hidden_layers - 1, u)).float()
        tokens, logprobs = sample(logits, params, generators, histories)
        return tokens, logprobs, logits

    @torch.inference_mode()
    def score(self, u: torch.Tensor, targets: torch.Tensor, k: int):
        """u [R, h] (input of the last feed-forward) and the token after each row [R] ->
        (their log-probs [R], the rows' k most likely tokens [R, k] and log-probs [R, k]):
        a prompt's log-probs, without sending [R, vocab] logits back."""
        self.calls += 1
        m = self.model
        last = m.config.num_hidden_layers - 1
        return score_rows(lambda x: m.final(m.mlp(last, x)), u, targets, k)
