"""One attention shard: a paged KV store for a subset of every sequence's positions.

Positions are spread over `num_shards` shards block by block, round robin:

    absolute block b = p // block_size   lives on shard  b % num_shards
    shard s, sequence blocks:  b = s, s + S, s + 2S, ...  -> local blocks 0, 1, 2, ...

`sweep` returns the partial-softmax aggregate `(O, lse)` of a query over this shard's keys
only (lse = −inf where it holds none), so the owner can merge shards in any order.
Contract: only the owning attention service calls a shard, one call at a time. Blocks are
taken in `reserve` and all returned by `free`.
"""
from __future__ import annotations

import torch

from kernels.attention import naive
from models.config import ModelConfig
from services.engine.block_manager import BlockManager


class KVShard:
    def __init__(self, cfg: ModelConfig, index: int, num_shards: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, name: str | None = None):
        self.index, self.num_shards, self.block_size = index, num_shards, block_size
        self.name = name or f"attn-shard-{index}"
        self.fa_index = {l: i for i, l in enumerate(cfg.full_attention_layers)}
        self.blocks = BlockManager(num_blocks, block_size)
        self.kv = torch.zeros(2, len(self.fa_index), num_blocks, block_size,
                              cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
        self.tables: dict[int, list[int]] = {}

    def owns(self, positions: torch.Tensor) -> torch.Tensor:
        return (positions // self.block_size) % self.num_shards == self.index

    def _local(self, positions: torch.Tensor) -> torch.Tensor:
        """Absolute positions (owned here) -> local position index within the sequence."""
        local_block = (positions // self.block_size) // self.num_shards
        return local_block * self.block_size + positions % self.block_size

    def blocks_needed(self, seq_id: int, length: int) -> int:
        """More blocks `seq_id` needs here to hold its owned positions < `length`."""
        abs_blocks = -(-length // self.block_size)
        owned = len(range(self.index, abs_blocks, self.num_shards))
        return max(0, owned - len(self.tables.get(seq_id, ())))

    def reserve(self, seq_id: int, length: int) -> None:
        """Make room for every owned position < `length` of `seq_id`."""
        need = self.blocks_needed(seq_id, length)
        table = self.tables.setdefault(seq_id, [])
        if need:
            table.extend(self.blocks.allocate(need))

    def free(self, seq_id: int) -> None:
        self.blocks.free(self.tables.pop(seq_id, []))

    def append(self, layer: int, seq_ids: list[int], positions: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        """Store rows whose positions this shard owns (others are ignored)."""
        mine = self.owns(positions)
        if not mine.any():
            return
        i = self.fa_index[layer]
        local = self._local(positions[mine])
        tables = [self.tables[s] for s, m in zip(seq_ids, mine.tolist()) if m]
        slots = torch.tensor([t[int(p) // self.block_size] * self.block_size
                              + int(p) % self.block_size for t, p in zip(tables, local)])
        self.kv[0, i].view(-1, *k.shape[1:])[slots] = k[mine].to(self.kv.dtype)
        self.kv[1, i].view(-1, *v.shape[1:])[slots] = v[mine].to(self.kv.dtype)

    def sweep(self, layer: int, seq_ids: list[int], q: torch.Tensor, limits: torch.Tensor):
        """q [N, H, D]; row r sees this shard's keys of seq_ids[r] at positions < limits[r].
        Returns (O [N, H, D] fp32, lse [N, H] fp32)."""
        i = self.fa_index[layer]
        o = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.full(q.shape[:2], float("-inf"))
        for seq in dict.fromkeys(seq_ids):
            rows = torch.tensor([r for r, s in enumerate(seq_ids) if s == seq])
            table = self.tables.get(seq, [])
            limit = int(limits[rows].max())
            if not table or limit <= 0:
                continue
            nb = len(table)
            local_blocks = torch.arange(nb)
            abs_block = local_blocks * self.num_shards + self.index
            key_pos = (abs_block[:, None] * self.block_size
                       + torch.arange(self.block_size)[None]).reshape(-1)      # [nb·bs]
            idx = torch.tensor(table)
            k = self.kv[0, i][idx].reshape(-1, *self.kv.shape[-2:])
            v = self.kv[1, i][idx].reshape(-1, *self.kv.shape[-2:])
            mask = key_pos[None, :] < limits[rows][:, None]                  # [n, nb·bs]
            o_s, lse_s = naive.attention_lse(q[rows][None], k[None], v[None], mask=mask[None])
            o[rows], lse[rows] = o_s[0], lse_s[0]
        return o, lse
