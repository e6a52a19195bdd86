"""Cache storage, allocated once: paged FA KV plus Gated DeltaNet state slots.

    kv:        [2, num_fa_layers, num_blocks, block_size, KV, D]    (model dtype)
    conv:      [num_gdn_layers, num_slots, conv_dim, Kc − 1]        (model dtype)
    recurrent: [num_gdn_layers, num_slots, HV, Dk, Dv]              (fp32)

Layers get views (`k(l)`, `v(l)`); nothing here allocates per step. The KV pages are
backed by memory only once a block is first written (`lazy_zeros`). Block ids and slot ids
come from `BlockManager` / `SlotPool`; this class only stores.
"""
from __future__ import annotations

import math
import mmap

import torch

from models.config import ModelConfig


def lazy_zeros(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero tensor whose CPU pages are only backed once written: an anonymous memory map
    (zero-filled by the kernel on first touch), so a cache sized for the worst case costs
    resident memory only for the blocks it has held. Elsewhere: `torch.zeros`."""
    if torch.device(device).type != "cpu":
        return torch.zeros(*shape, dtype=dtype, device=device)
    count = math.prod(shape)
    size = count * torch.empty((), dtype=dtype).element_size()
    if size == 0:
        return torch.zeros(*shape, dtype=dtype)
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # zero-filled
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(*shape)


class CacheStorage:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.block_size = block_size
        self.fa_index = {l: i for i, l in enumerate(cfg.full_attention_layers)}
        self.gdn_index = {l: i for i, l in enumerate(cfg.linear_attention_layers)}
        kvh, d = cfg.num_key_value_heads, cfg.head_dim
        self.kv = lazy_zeros(2, len(self.fa_index), num_blocks, block_size, kvh, d,
                             dtype=dtype, device=device)
        self.conv = self.recurrent = None
        if self.gdn_index:
            self.conv = torch.zeros(len(self.gdn_index), num_slots, cfg.gdn_conv_dim,
                                    cfg.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
            self.recurrent = torch.zeros(len(self.gdn_index), num_slots,
                                         cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                         cfg.linear_value_head_dim, dtype=torch.float32,
                                         device=device)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return (2 * len(cfg.full_attention_layers) * block_size * cfg.num_key_value_heads
                * cfg.head_dim * elem)

    def k(self, layer: int) -> torch.Tensor:
        return self.kv[0, self.fa_index[layer]]

    def v(self, layer: int) -> torch.Tensor:
        return self.kv[1, self.fa_index[layer]]

    def write_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [N] flat token slots (block * block_size + offset); k, v [N, KV, D]."""
        i = self.fa_index[layer]
        kvh, d = k.shape[-2:]
        self.kv[0, i].view(-1, kvh, d)[slots] = k.to(self.kv.dtype)
        self.kv[1, i].view(-1, kvh, d)[slots] = v.to(self.kv.dtype)

    def write_kv_all(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """kv [F, 2, N, KV, D] (every full-attention layer, as `read_rows` gives it) into
        flat slots [N]."""
        self.kv.flatten(2, 3)[:, :, slots] = kv.transpose(0, 1).to(self.kv)

    def token_slots(self, block_table: list[int], n: int) -> torch.Tensor:
        """Flat slots (block * block_size + offset) of positions [0, n) of a block table."""
        bs, pos = self.block_size, torch.arange(n)
        table = torch.tensor(block_table, dtype=torch.long)
        return (table[pos // bs] * bs + pos % bs).to(self.kv.device)

    def read_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [N] flat token slots -> a copy of their KV, [F, 2, N, KV, D] (a
        transposed view of the gathered copy)."""
        return self.kv.flatten(2, 3)[:, :, slots].transpose(0, 1)

    def reset_slot(self, slot: int) -> None:
        if self.conv is not None:
            self.conv[:, slot].zero_()
            self.recurrent[:, slot].zero_()
