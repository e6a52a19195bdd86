"""Rotary position embedding: half-split (NeoX) layout, optional partial rotary, llama3 scaling."""
from __future__ import annotations

import math

import torch

from models.config import RopeConfig


def inv_frequencies(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """[rotary_dim / 2] fp32 inverse frequencies."""
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    inv = 1.0 / (rope.theta ** exps)
    if rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wl = old / rope.low_freq_factor
        high_wl = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        s = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smooth = (1 - s) * inv_l / rope.factor + s * inv_l
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = torch.where(medium, smooth, inv_l)
    return inv


class Rotary:
    """Applies RoPE to the first `rotary_dim` channels of each head; passes the rest through."""

    def __init__(self, rope: RopeConfig, head_dim: int, rotary_dim: int):
        self.rotary_dim = rotary_dim
        self.head_dim = head_dim
        self.inv_freq = inv_frequencies(rope, rotary_dim)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None   # fp32 [P, rotary_dim]

    def _tables(self, max_pos: int, device: torch.device):
        """fp32 cos/sin for positions [0, P), P grown by doubling; each row is computed
        exactly as on the fly (pos · inv_freq), so lookups change no value."""
        if self._table is None or self._table[0].shape[0] < max_pos \
                or self._table[0].device != device:
            size = max(256, 1 << (max_pos - 1).bit_length())
            pos = torch.arange(size, device=device).float()
            freqs = pos[:, None] * self.inv_freq.to(device)
            emb = torch.cat([freqs, freqs], dim=-1)
            self._table = (emb.cos(), emb.sin())
        return self._table

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [*] long -> cos, sin [*, rotary_dim] in `dtype` (computed in fp32)."""
        cos, sin = self._tables(int(positions.max()) + 1, positions.device)
        return cos[positions].to(dtype), sin[positions].to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [*, heads, D]; cos/sin [*, rotary_dim]."""
        rd = self.rotary_dim
        cos, sin = cos[..., None, :], sin[..., None, :]
        rot, rest = x[..., :rd], x[..., rd:]
        half = rd // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = rot * cos + rotated * sin
        return out if rd == self.head_dim else torch.cat([out, rest], dim=-1)
