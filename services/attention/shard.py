"""One attention shard: paged KV storage for a subset of every sequence's positions.

The engine's block manager hands out *logical* blocks of `block_size · num_shards` tokens;
logical block id b is physical block b on every shard, and inside it the positions are
spread over the shards `block_size` at a time, round robin:

    position p   ->  shard (p // block_size) % num_shards
                     logical block table[p // (block_size · num_shards)], offset p % block_size

    logical block (block_size · S tokens):  | shard 0 | shard 1 | ... | shard S−1 |

So a sequence's local blocks on every shard are its block table itself, and each shard's
keys for that sequence are a prefix of its local positions. `sweep` returns the
partial-softmax aggregate `(O, lse)` of a query over this shard's keys only (lse = −inf
where it holds none), so the owner can merge shards in any order. Contract: only the
owning runner calls a shard, one call at a time; it allocates nothing (the engine owns
block ids).

Pages are head-major, `kv [2, F, KV, num_blocks, block_size, D]`, so one KV head's keys in a
stretch of consecutive block ids are one contiguous `[n·block_size, D]` matrix. The decode
rows of a step (one row per sequence) go to the native batched kernel
(`kernels.attention.cpu_paged`) in one call; prompt rows, or every row without that kernel,
read each stretch ("run") in place with the fused CPU kernel and merge the runs'
`(O, lse)`; `sweep_reference` gathers every block and runs the naive kernel.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.attention import cpu_flash, cpu_paged, naive
from models.config import ModelConfig
from services.engine.kv_cache import lazy_zeros

MAX_RUNS = cpu_flash.MAX_RUNS   # a table more fragmented than this is gathered instead
ROW_CHUNK = 256                 # masked (prompt) rows per kernel call: bounds the mask


def table_runs(table: list[int]) -> list[tuple[int, int]]:
    """A block table as runs of consecutive ids: [(first id, count), ...]."""
    runs: list[list[int]] = []
    for b in table:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    return [(first, count) for first, count in runs]


class SeqRows(NamedTuple):
    """One sequence's rows of a step, as every shard sees them."""
    rows: list[int]                  # row indices into the step's q
    table: list[int]                 # the sequence's (logical) block table
    runs: list[tuple[int, int]]      # `table_runs(table)`


ROW_QUERIES = 8     # a sequence of at most this many rows in a step sweeps a row at a time,
                   # in the native kernel's one call (a draft step's 1 + k rows)


class DecodePlan(NamedTuple):
    """A step's one-row sequences for the native paged kernel (`KVShard.plan`)."""
    rows: list[int]                  # their row indices into the step's q
    prepared: object                 # `cpu_paged.Prepared` (None when there are none)
    rest: list[SeqRows]              # the step's other sequences
    whole: bool                      # no rest, and rows are 0, 1, ...: a decode-only sweep


class KVShard:
    def __init__(self, cfg: ModelConfig, index: int, num_shards: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, name: str | None = None,
                 device: str | torch.device = "cpu"):
        self.index, self.num_shards, self.block_size = index, num_shards, block_size
        self.name = name or f"attn-shard-{index}"
        self.fa_index = {l: i for i, l in enumerate(cfg.full_attention_layers)}
        self.kv = lazy_zeros(2, len(self.fa_index), cfg.num_key_value_heads, num_blocks,
                             block_size, cfg.head_dim, dtype=dtype, device=device)

    def owns(self, positions: torch.Tensor) -> torch.Tensor:
        return (positions // self.block_size) % self.num_shards == self.index

    def _num_local(self, limit: int) -> int:
        """How many of a sequence's keys here sit at positions < `limit` (a prefix of them)."""
        full, part = divmod(limit, self.block_size)
        n = len(range(self.index, full, self.num_shards)) * self.block_size
        return n + (part if full % self.num_shards == self.index else 0)

    def slots(self, tables: list[list[int]], positions: list[int]) -> tuple[list[int], list[int]]:
        """Of rows (table, position), those this shard stores -> (row indices, flat slots)."""
        bs, shards = self.block_size, self.num_shards
        rows, slots = [], []
        for r, (table, p) in enumerate(zip(tables, positions)):
            if (p // bs) % shards == self.index:
                rows.append(r)
                slots.append(table[p // (bs * shards)] * bs + p % bs)
        return rows, slots

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, KV, D] into flat slots [n] (block · block_size + offset) of `layer`."""
        if not len(slots):
            return
        i = self.fa_index[layer]
        kvh, d = self.kv.shape[2], self.kv.shape[-1]
        idx = slots.to(self.kv.device)
        self.kv[0, i].view(kvh, -1, d).index_copy_(1, idx, k.transpose(0, 1).to(self.kv))
        self.kv[1, i].view(kvh, -1, d).index_copy_(1, idx, v.transpose(0, 1).to(self.kv))

    def write_prompt(self, layer: int, table: list[int], k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """Store positions [0, N) of a sequence with block table `table` that this shard
        owns; k, v [N, KV, D] (a prompt prefilled elsewhere)."""
        bs, n = self.block_size, k.shape[0]
        block = torch.arange(n) // bs
        own = block % self.num_shards == self.index
        if not bool(own.any()):
            return
        t = torch.tensor(table, dtype=torch.long)
        slots = t[block[own] // self.num_shards] * bs + torch.arange(n)[own] % bs
        self.write(layer, slots, k[own], v[own])

    def plan(self, seqs: list[SeqRows], limits: list[int], num_heads: int) -> DecodePlan:
        """What `sweep` needs for the short sequences of `seqs` (decode rows, and the 1 + k
        rows of a draft step: at most `ROW_QUERIES` rows), built once per step and reused by
        every layer: their rows, each a one-row query over its own prefix, and the native
        kernel's tables and lengths (`cpu_paged.prepare`)."""
        short = [s for s in seqs if len(s.rows) <= ROW_QUERIES and s.table]
        rest = [s for s in seqs if not (len(s.rows) <= ROW_QUERIES and s.table)]
        if not short:
            return DecodePlan([], None, rest, False)
        width = max(len(s.table) for s in short)
        tables = torch.tensor([s.table + [-1] * (width - len(s.table))
                               for s in short for _ in s.rows])
        lens = torch.tensor([self._num_local(limits[r]) for s in short for r in s.rows])
        prepared = cpu_paged.prepare(tables, lens, self.block_size, num_heads,
                                     self.kv.shape[-1])
        rows = [r for s in short for r in s.rows]
        return DecodePlan(rows, prepared, rest, not rest and rows == list(range(len(rows))))

    def sweep(self, layer: int, seqs: list[SeqRows], q: torch.Tensor, limits: list[int],
              plan: DecodePlan | None = None):
        """q [N, H, D]; each row r of `seqs` sees this shard's keys of its sequence at
        positions < limits[r]. Rows in no entry of `seqs` are left empty. `plan`: this
        step's `plan(seqs, limits, H)`. Returns (O [N, H, D] fp32, lse [N, H] fp32)."""
        if self.kv.device.type != "cpu":
            return self.sweep_reference(layer, seqs, q, limits)
        i = self.fa_index[layer]
        native = cpu_paged.supports(q, self.kv, self.kv.shape[2], self.kv.shape[-1])
        if native:
            plan = plan or self.plan(seqs, limits, q.shape[1])
            if plan.whole and len(plan.rows) == q.shape[0]:    # a decode-only sweep
                return cpu_paged.decode(q, self.kv[0, i], self.kv[1, i], head_major=True,
                                        prepared=plan.prepared)
        o = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.full(q.shape[:2], float("-inf"))
        if native:
            if plan.rows:
                o[plan.rows], lse[plan.rows] = cpu_paged.decode(
                    q[plan.rows], self.kv[0, i], self.kv[1, i], head_major=True,
                    prepared=plan.prepared)
            seqs = plan.rest
        for rows, table, runs in seqs:
            counts = [self._num_local(limits[r]) for r in rows]
            n = max(counts)
            if n <= 0 or not table:
                continue
            if len(rows) == 1 or min(counts) == n:      # every row sees the same keys
                o_s, lse_s = self._sweep_keys(i, runs, q[rows], n)
                o[rows], lse[rows] = o_s, lse_s
                continue
            k, v = self._keys(i, runs, n)                # [KV, n, D] each
            seen = torch.tensor(counts)
            for c in range(0, len(rows), ROW_CHUNK):     # prompt rows: a prefix each
                part = rows[c:c + ROW_CHUNK]
                mask = torch.arange(n)[None] < seen[c:c + ROW_CHUNK, None]   # [r, n]
                o_s, lse_s = cpu_flash.attention_lse(
                    q[part][None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                    mask=mask[None])
                empty = ~mask.any(1)
                o[part] = o_s[0].float().masked_fill(empty[:, None, None], 0.0)
                lse[part] = lse_s[0].masked_fill(empty[:, None], float("-inf"))
        return o, lse

    def _segments(self, i: int, runs, n: int):
        """In-place `[KV, len, D]` views of K and V covering the first `n` local keys, one per
        run of consecutive blocks."""
        left = n
        for first, count in runs:
            keys = min(left, count * self.block_size)
            pages = self.kv[:, i, :, first:first + count].flatten(2, 3)     # [2, KV, c·bs, D]
            yield pages[0, :, :keys], pages[1, :, :keys]
            left -= keys
            if left <= 0:
                return

    def _keys(self, i: int, runs, n: int):
        """K, V [KV, n, D] of the first `n` local keys (a view when they are one run)."""
        segs = list(self._segments(i, runs, n))
        if len(segs) == 1:
            return segs[0]
        return torch.cat([s[0] for s in segs], 1), torch.cat([s[1] for s in segs], 1)

    def _sweep_keys(self, i: int, runs, q: torch.Tensor, n: int):
        """Rows q [r, H, D] that all see the first `n` local keys -> (O [r, H, D], lse [r, H])."""
        segs = [self._keys(i, runs, n)] if len(runs) > MAX_RUNS else self._segments(i, runs, n)
        return cpu_flash.segments_lse(q, [(k.transpose(0, 1), v.transpose(0, 1))
                                          for k, v in segs])

    def sweep_reference(self, layer: int, seqs: list[SeqRows], q: torch.Tensor,
                        limits: list[int]):
        """`sweep` by gathering every block of the sequence and masking: the naive kernel,
        on any device."""
        i = self.fa_index[layer]
        dev = q.device
        o = torch.zeros(q.shape, dtype=torch.float32, device=dev)
        lse = torch.full(q.shape[:2], float("-inf"), device=dev)
        for rows, table, _ in seqs:
            lim = torch.tensor([limits[r] for r in rows], device=dev)
            if not table or int(lim.max()) <= 0:
                continue
            idx = torch.tensor(rows, device=dev)
            abs_block = torch.arange(len(table), device=dev) * self.num_shards + self.index
            key_pos = (abs_block[:, None] * self.block_size
                       + torch.arange(self.block_size, device=dev)[None]).reshape(-1)
            blocks = torch.tensor(table, device=dev)
            k, v = (self.kv[j, i][:, blocks].flatten(1, 2).transpose(0, 1) for j in (0, 1))
            mask = key_pos[None, :] < lim[:, None]                           # [n, nb·bs]
            o_s, lse_s = naive.attention_lse(q[idx][None], k[None], v[None], mask=mask[None])
            o[idx], lse[idx] = o_s[0], lse_s[0]
        return o, lse
