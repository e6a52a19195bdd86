"""Rotary position embedding: half-split (NeoX) layout, optional partial rotary, llama3 scaling."""
from __future__ import annotations

import math
from contextlib import contextmanager

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
        self._last: tuple | None = None   # (positions copy, dtype, cos, sin)
        self._no_sync = False

    def _tables(self, max_pos: int, device: torch.device):
        """fp32 cos/sin for positions [0, P), P grown by doubling; each row is computed
        exactly as on the fly (pos · inv_freq), so lookups change no value."""
        if self._table is None or self._table[0].shape[0] < max_pos \
                or self._table[0].device != device:
            size = max(256, 1 << (max_pos - 1).bit_length())
            pos = torch.arange(size, device=device).float()
            freqs = pos[:, None] * self.inv_freq.to(device)
            emb = torch.cat([freqs, freqs], dim=-1)
            # sin carries the rotation's sign: rotate_half(x) · sin == roll(x) · signed sin
            sin = emb.sin()
            sin[:, :self.rotary_dim // 2].neg_()
            self._table = (emb.cos(), sin)
        return self._table

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [*] long -> cos, signed sin [*, rotary_dim] in `dtype` (computed in fp32;
        the first half of sin negated, the form `apply` takes).

        Every layer of a step asks for the same positions, so the last lookup is kept and
        reused when the positions are equal (one comparison instead of the lookup)."""
        if self._no_sync:
            cos, sin = self._table
            return cos[positions].to(dtype), sin[positions].to(dtype)
        last = self._last
        if last is not None and last[1] == dtype and last[0].shape == positions.shape \
                and last[0].device == positions.device and torch.equal(last[0], positions):
            return last[2], last[3]
        cos, sin = self._tables(int(positions.max()) + 1, positions.device)
        cos, sin = cos[positions].to(dtype), sin[positions].to(dtype)
        self._last = (positions.clone(), dtype, cos, sin)
        return cos, sin

    @contextmanager
    def without_host_sync(self, max_pos: int, device: torch.device):
        """Within: lookups that never wait for the device (CUDA graph capture): the tables
        for positions [0, max_pos) are made on entry and indexed as they are, with no
        comparison with the last lookup and no growth (positions must stay below max_pos)."""
        self._tables(max_pos, device)
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [*, heads, D]; cos / signed sin [*, rotary_dim] from `cos_sin`.

        x·cos + rotate_half(x)·sin with rotate_half(x) = [−x₂, x₁]: written as
        roll(x)·[−sin₁, sin₂] (roll(x) = [x₂, x₁]), the same products and sums, bit for bit."""
        rd = self.rotary_dim
        cos, sin = cos[..., None, :], sin[..., None, :]
        rot = x if rd == self.head_dim else x[..., :rd]
        out = rot * cos + torch.roll(rot, rd // 2, dims=-1) * sin
        return out if rd == self.head_dim else torch.cat([out, x[..., rd:]], dim=-1)
