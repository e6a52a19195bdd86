"""One attention shard: a paged KV store for a subset of every sequence's positions.

Positions are spread over `num_shards` shards block by block, round robin:

    absolute block b = p // block_size   lives on shard  b % num_shards
    shard s, sequence blocks:  b = s, s + S, s + 2S, ...  -> local blocks 0, 1, 2, ...

`sweep` returns the partial-softmax aggregate `(O, lse)` of a query over this shard's keys
only (lse = −inf where it holds none), so the owner can merge shards in any order.
Contract: only the owning attention service calls a shard, one call at a time. Blocks are
taken in `reserve` and all returned by `free`.

Pages are head-major, `kv [2, F, KV, num_blocks, block_size, D]`, so one KV head's keys in a
stretch of consecutive block ids are one contiguous `[n·block_size, D]` matrix. The decode
sweep reads each such stretch ("run") in place with the fused CPU kernel and merges the
runs' `(O, lse)`; `sweep_reference` gathers every block and runs the naive kernel.
"""
from __future__ import annotations

import torch

from kernels.attention import cpu_flash, naive
from models.config import ModelConfig
from services.engine.block_manager import BlockManager

MAX_RUNS = cpu_flash.MAX_RUNS   # a table more fragmented than this is gathered instead
ROW_CHUNK = 256                 # masked (prompt) rows per kernel call: bounds the mask


class KVShard:
    def __init__(self, cfg: ModelConfig, index: int, num_shards: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, name: str | None = None,
                 device: str | torch.device = "cpu"):
        self.index, self.num_shards, self.block_size = index, num_shards, block_size
        self.name = name or f"attn-shard-{index}"
        self.fa_index = {l: i for i, l in enumerate(cfg.full_attention_layers)}
        self.blocks = BlockManager(num_blocks, block_size)
        self.kv = torch.zeros(2, len(self.fa_index), cfg.num_key_value_heads, num_blocks,
                              block_size, cfg.head_dim, dtype=dtype, device=device)
        self.tables: dict[int, list[int]] = {}
        self.runs: dict[int, list[list[int]]] = {}   # seq -> [[first block id, blocks], ...]

    def owns(self, positions: torch.Tensor) -> torch.Tensor:
        return (positions // self.block_size) % self.num_shards == self.index

    def _num_local(self, limit: int) -> int:
        """How many of a sequence's keys here sit at positions < `limit` (a prefix of them)."""
        full, part = divmod(limit, self.block_size)
        n = len(range(self.index, full, self.num_shards)) * self.block_size
        return n + (part if full % self.num_shards == self.index else 0)

    def blocks_needed(self, seq_id: int, length: int) -> int:
        """More blocks `seq_id` needs here to hold its owned positions < `length`."""
        abs_blocks = -(-length // self.block_size)
        owned = len(range(self.index, abs_blocks, self.num_shards))
        return max(0, owned - len(self.tables.get(seq_id, ())))

    def reserve(self, seq_id: int, length: int) -> None:
        """Make room for every owned position < `length` of `seq_id`."""
        need = self.blocks_needed(seq_id, length)
        table = self.tables.setdefault(seq_id, [])
        runs = self.runs.setdefault(seq_id, [])
        if need:
            new = self.blocks.allocate(need)
            table.extend(new)
            for b in new:
                if runs and runs[-1][0] + runs[-1][1] == b:
                    runs[-1][1] += 1
                else:
                    runs.append([b, 1])

    def free(self, seq_id: int) -> None:
        self.runs.pop(seq_id, None)
        self.blocks.free(self.tables.pop(seq_id, []))

    def append(self, layer: int, seq_ids: list[int], positions: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        """Store rows whose positions this shard owns (others are ignored)."""
        bs, shards = self.block_size, self.num_shards
        rows, slots = [], []
        for r, (seq, p) in enumerate(zip(seq_ids, positions.tolist())):
            if (p // bs) % shards == self.index:
                rows.append(r)
                slots.append(self.tables[seq][p // bs // shards] * bs + p % bs)
        if not rows:
            return
        i = self.fa_index[layer]
        if len(rows) < len(seq_ids):
            k, v = k[rows], v[rows]
        idx = torch.tensor(slots, device=self.kv.device)
        kvh, d = self.kv.shape[2], self.kv.shape[-1]
        self.kv[0, i].view(kvh, -1, d).index_copy_(1, idx, k.transpose(0, 1).to(self.kv))
        self.kv[1, i].view(kvh, -1, d).index_copy_(1, idx, v.transpose(0, 1).to(self.kv))

    def write_prompt(self, layer: int, seq_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store positions [0, N) of `seq_id` that this shard owns; k, v [N, KV, D] (a
        prompt prefilled elsewhere). Its blocks must be reserved."""
        bs, n = self.block_size, k.shape[0]
        block = torch.arange(n) // bs
        own = block % self.num_shards == self.index
        if not bool(own.any()):
            return
        table = torch.tensor(self.tables[seq_id], dtype=torch.long)
        slots = table[block[own] // self.num_shards] * bs + torch.arange(n)[own] % bs
        i = self.fa_index[layer]
        kvh, d = self.kv.shape[2], self.kv.shape[-1]
        idx = slots.to(self.kv.device)
        self.kv[0, i].view(kvh, -1, d).index_copy_(1, idx, k[own].transpose(0, 1).to(self.kv))
        self.kv[1, i].view(kvh, -1, d).index_copy_(1, idx, v[own].transpose(0, 1).to(self.kv))

    def _groups(self, seq_ids: list[int]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for r, s in enumerate(seq_ids):
            groups.setdefault(s, []).append(r)
        return groups

    def sweep(self, layer: int, seq_ids: list[int], q: torch.Tensor, limits: torch.Tensor):
        """q [N, H, D]; row r sees this shard's keys of seq_ids[r] at positions < limits[r].
        Returns (O [N, H, D] fp32, lse [N, H] fp32)."""
        if self.kv.device.type != "cpu":
            return self.sweep_reference(layer, seq_ids, q, limits)
        i = self.fa_index[layer]
        o = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.full(q.shape[:2], float("-inf"))
        lim = limits.tolist()
        for seq, rows in self._groups(seq_ids).items():
            counts = [self._num_local(lim[r]) for r in rows]
            n = max(counts)
            if n <= 0 or seq not in self.tables:
                continue
            if len(rows) == 1 or min(counts) == n:      # every row sees the same keys
                o_s, lse_s = self._sweep_keys(i, seq, q[rows], n)
                o[rows], lse[rows] = o_s, lse_s
                continue
            k, v = self._keys(i, seq, n)                 # [KV, n, D] each
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

    def _segments(self, i: int, seq: int, n: int):
        """In-place `[KV, len, D]` views of K and V covering the first `n` local keys, one per
        run of consecutive blocks."""
        left = n
        for first, count in self.runs[seq]:
            keys = min(left, count * self.block_size)
            pages = self.kv[:, i, :, first:first + count].flatten(2, 3)     # [2, KV, c·bs, D]
            yield pages[0, :, :keys], pages[1, :, :keys]
            left -= keys
            if left <= 0:
                return

    def _keys(self, i: int, seq: int, n: int):
        """K, V [KV, n, D] of the first `n` local keys (a view when they are one run)."""
        segs = list(self._segments(i, seq, n))
        if len(segs) == 1:
            return segs[0]
        return torch.cat([s[0] for s in segs], 1), torch.cat([s[1] for s in segs], 1)

    def _sweep_keys(self, i: int, seq: int, q: torch.Tensor, n: int):
        """Rows q [r, H, D] that all see the first `n` local keys -> (O [r, H, D], lse [r, H])."""
        segs = ([self._keys(i, seq, n)] if len(self.runs[seq]) > MAX_RUNS
                else self._segments(i, seq, n))
        return cpu_flash.segments_lse(q, [(k.transpose(0, 1), v.transpose(0, 1))
                                          for k, v in segs])

    def sweep_reference(self, layer: int, seq_ids: list[int], q: torch.Tensor,
                        limits: torch.Tensor):
        """`sweep` by gathering every block of the sequence and masking: the naive kernel,
        on any device."""
        i = self.fa_index[layer]
        dev = q.device
        o = torch.zeros(q.shape, dtype=torch.float32, device=dev)
        lse = torch.full(q.shape[:2], float("-inf"), device=dev)
        for seq, rows in self._groups(seq_ids).items():
            rows = torch.tensor(rows, device=dev)
            table = self.tables.get(seq, [])
            if not table or int(limits[rows].max()) <= 0:
                continue
            abs_block = torch.arange(len(table), device=dev) * self.num_shards + self.index
            key_pos = (abs_block[:, None] * self.block_size
                       + torch.arange(self.block_size, device=dev)[None]).reshape(-1)
            idx = torch.tensor(table, device=dev)
            k, v = (self.kv[j, i][:, idx].flatten(1, 2).transpose(0, 1) for j in (0, 1))
            mask = key_pos[None, :] < limits[rows][:, None]                  # [n, nb·bs]
            o_s, lse_s = naive.attention_lse(q[rows][None], k[None], v[None], mask=mask[None])
            o[rows], lse[rows] = o_s[0], lse_s[0]
        return o, lse
