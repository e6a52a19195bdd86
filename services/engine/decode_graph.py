"""Decode-only engine steps through CUDA graphs, one per (batch bucket, key-length bucket).

A step of B decode rows whose longest row sees n keys runs at the smallest batch bucket
>= B and key-length bucket >= n, on static buffers:

    rows   0 .. B−1 the step's rows      B .. Bb−1 copies of row 0 (same token, position,
                                         KV slot, state slot and keys: they write what
                                         row 0 writes, so the step is exact)
    keys   0 .. len−1 the row's keys     len .. Lb−1 masked (gathered from slot 0)

Rotary lookups run without host syncs inside (`Rotary.without_host_sync`), the paged plan
is built on the host and copied in. A model whose step cannot be captured (a MoE layer
lists its experts on the host) runs the same padded step eagerly (`GraphCache`). Off CUDA
(`capture=False`) the padded step always runs eagerly: the tests check the padding there.
On with `SPLITSTACK_DECODE_GRAPHS=1` for a model on CUDA.
"""
from __future__ import annotations

import os

import torch

from kernels.attention.naive import PagedPlan, key_mask
from kernels.cuda_graph import GraphCache, bucket_for, pow2_buckets
from services.engine.scheduler import SchedulerOutput

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
ENV = "SPLITSTACK_DECODE_GRAPHS"


def enabled(device) -> bool:
    return torch.device(device).type == "cuda" and os.environ.get(ENV, "0") == "1"


class DecodeGraphs:
    """The runner's decode-only steps at bucketed shapes; `runner` is a `ModelRunner`
    (its layer functions run the step). Engine thread only."""

    def __init__(self, runner, max_len: int, batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
                 capture: bool | None = None):
        self.runner, self.model, self.cache = runner, runner.model, runner.cache
        bs = self.cache.block_size
        self.max_len = max_len
        # key lengths in whole blocks, so that a bucket's block table has L / bs entries
        self.len_buckets = pow2_buckets(max(bs, min(256, max_len)), max_len)
        self.batch_buckets = tuple(sorted(batch_buckets))
        if capture is None:
            capture = torch.device(self.model.device).type == "cuda"
        self.graphs = GraphCache(self._step, self._inputs, capture=capture)

    def applies(self, out: SchedulerOutput) -> bool:
        return (bool(out.decode) and not out.prefill
                and bucket_for(len(out.decode), self.batch_buckets) is not None
                and max(c.start + 1 for c in out.decode) <= self.len_buckets[-1])

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits [B, vocab] fp32 of the step's decode rows (the runner's `run` contract)."""
        n = len(out.decode)
        batch = bucket_for(n, self.batch_buckets)
        length = bucket_for(max(c.start + 1 for c in out.decode), self.len_buckets)
        host = self._host_inputs(out, batch, length)

        def fill(inputs):
            for dst, src in zip(inputs, host):
                dst.copy_(src, non_blocking=True)

        logits, = self.graphs.run((batch, length), fill)
        return logits[:n].clone()

    def _host_inputs(self, out: SchedulerOutput, batch: int, length: int):
        bs, rows = self.cache.block_size, out.decode + [out.decode[0]] * (batch - len(out.decode))
        width = length // bs
        pos = [c.start for c in rows]
        tables = torch.tensor([(c.seq.block_table + [-1] * width)[:width] for c in rows],
                              dtype=torch.long)
        positions = torch.tensor(pos, dtype=torch.long)
        slots = tables[torch.arange(batch), positions // bs] * bs + positions % bs
        keys = torch.arange(length)
        gather = tables[:, keys // bs].clamp(min=0) * bs + keys % bs
        lens = positions + 1
        mask = key_mask(1, length, lens, positions, causal=True)
        state = torch.tensor([c.seq.state_slot if c.seq.state_slot is not None else 0
                              for c in rows], dtype=torch.long)
        ids = torch.tensor([c.seq.tokens[c.start] for c in rows], dtype=torch.long)
        return ids, positions, slots, state, gather, mask, tables, lens

    def _inputs(self, key):
        batch, length = key
        dev = self.model.device

        def z(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=dev)

        return (z(batch), z(batch), z(batch), z(batch), z(batch, length),
                z(batch, 1, length, dtype=torch.bool), z(batch, length // self.cache.block_size),
                z(batch))

    @torch.inference_mode()
    def _step(self, ids, positions, slots, state, gather, mask, tables, lens):
        plan = PagedPlan(gather, mask, tables, lens, positions)
        with self.model.rotary.without_host_sync(self.len_buckets[-1], ids.device):
            return (self.runner.decode_step(ids, positions, slots, plan, state),)
