"""Tail-Replay through CUDA graphs: one graph per bucketed tail length.

A tail of k rows runs at the smallest bucket K >= k with K − k leading rows of zeros:
the embeddings of those rows masked to zero and their hiddens zero. That is exact: a zero
row stays zero through every layer of a group (RMSNorm, bias-free projections, the causal
conv from a zero state, silu, output gate and feed-forward all map 0 to 0), and with
k = v = 0 the delta rule leaves the zero state at zero whatever the row's decay; the conv
state keeps the last Kc − 1 inputs, all real rows since k >= Kc − 1. So the states equal an
unpadded replay's up to the rounding of other chunk boundaries.

    bucket K = 512, tail k = 300
    rows    [0, 212) zeros          [212, 512) the tail's ids / hiddens
"""
from __future__ import annotations

import torch

from kernels.cuda_graph import GraphCache, bucket_for, pow2_buckets
from models.model import CausalLM
from services.prefix_cache.replay import GDNStates, hidden_layers, tail_replay

DEFAULT_BUCKETS = pow2_buckets(64, 4096)


class GraphedTailReplay:
    """`tail_replay(model, tail_ids, tail_hidden, ffn_skip)` at bucketed lengths; a graph per
    bucket on CUDA (`capture=None`: when the model is on CUDA), the same padded runs eagerly
    elsewhere. Tails past the largest bucket run `tail_replay` itself. Engine thread only."""

    def __init__(self, model: CausalLM, ffn_skip: bool = True,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, capture: bool | None = None):
        self.model, self.ffn_skip, self.buckets = model, ffn_skip, tuple(sorted(buckets))
        self._groups = len(hidden_layers(model.config))
        if capture is None:
            capture = torch.device(model.device).type == "cuda"
        self.graphs = GraphCache(self._replay, self._inputs, capture=capture)

    def _inputs(self, k: int):
        dev, cfg = self.model.device, self.model.config
        ids = torch.zeros(k, dtype=torch.long, device=dev)
        keep = torch.zeros(k, 1, dtype=self.model.dtype, device=dev)
        hidden = (torch.zeros(self._groups, k, cfg.hidden_size, dtype=self.model.dtype,
                              device=dev) if self._groups else None)
        return ids, keep, hidden

    @torch.inference_mode()
    def _replay(self, ids, keep, hidden):
        states = tail_replay(self.model, ids, hidden, self.ffn_skip, row_mask=keep)
        return states.conv, states.recurrent

    @torch.inference_mode()
    def __call__(self, tail_ids: torch.Tensor, tail_hidden: torch.Tensor | None) -> GDNStates:
        """tail_ids [k], tail_hidden [G, k, H] or None -> the states (tensors of their own)."""
        k = tail_ids.numel()
        bucket = bucket_for(k, self.buckets)
        if bucket is None:
            return tail_replay(self.model, tail_ids, tail_hidden, self.ffn_skip)
        pad = bucket - k

        def fill(inputs):
            ids, keep, hidden = inputs
            ids[:pad] = 0
            ids[pad:] = tail_ids.to(ids.device, non_blocking=True)
            keep[:pad] = 0
            keep[pad:] = 1
            if hidden is not None:
                hidden[:, :pad] = 0
                hidden[:, pad:] = tail_hidden.to(hidden.device, hidden.dtype, non_blocking=True)

        conv, recurrent = self.graphs.run(bucket, fill)
        return GDNStates(conv.clone(), recurrent.clone())
