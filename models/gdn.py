"""Gated DeltaNet (linear_attention) layer: projections, conv + gates + delta rule, output.

Two checkpoint layouts feed the same math (as the two families' HF checkpoints store them):
- "grouped" (Qwen3-Next): `in_proj_qkvz` rows grouped by key head, `in_proj_ba` likewise;
- "flat" (Qwen3.5): `in_proj_qkv` = [q_all | k_all | v_all], separate `in_proj_z/b/a`.
Both produce `mixed` with conv channels ordered q_all, k_all, v_all.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels.conv import causal_conv1d
from kernels.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
from models.config import ModelConfig
from models.layers import GatedRMSNorm, Linear


class GDNInputs(NamedTuple):
    mixed: torch.Tensor    # [*, conv_dim]  pre-conv q|k|v channels
    z: torch.Tensor | None  # [*, HV, Dv]   output gate (None: the rows' output is not wanted)
    b: torch.Tensor        # [*, HV]        beta logits
    a: torch.Tensor        # [*, HV]        decay logits


def map_inputs(inp: GDNInputs, fn) -> GDNInputs:
    """`fn` applied to every tensor of `inp` (a missing z stays missing)."""
    return GDNInputs(*(None if t is None else fn(t) for t in inp))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.layout = cfg.gdn_layout
        key_dim, value_dim, conv_dim = cfg.gdn_key_dim, cfg.gdn_value_dim, cfg.gdn_conv_dim
        if self.layout == "grouped":
            self.in_proj_qkvz = Linear(h, 2 * key_dim + 2 * value_dim, bias=False)
            self.in_proj_ba = Linear(h, 2 * self.hv, bias=False)
        else:
            self.in_proj_qkv = Linear(h, conv_dim, bias=False)
            self.in_proj_z = Linear(h, value_dim, bias=False)
            self.in_proj_b = Linear(h, self.hv, bias=False)
            self.in_proj_a = Linear(h, self.hv, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.linear_conv_kernel_dim, groups=conv_dim,
                                bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(value_dim, h, bias=False)

    def inputs(self, xn: torch.Tensor, with_z: bool = True) -> GDNInputs:
        """xn [*, h] (already normed) -> GDNInputs. `with_z=False`: rows whose output is
        never used (they only advance the state) skip the output gate's projection where the
        layout keeps it apart (flat); z is None then."""
        lead = xn.shape[:-1]
        if self.layout == "grouped":
            r = self.hv // self.hk
            p = self.in_proj_qkvz(xn).view(*lead, self.hk, 2 * self.dk + 2 * r * self.dv)
            q, k, v, z = p.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
            ba = self.in_proj_ba(xn).view(*lead, self.hk, 2 * r)
            b, a = ba.split([r, r], dim=-1)
            mixed = torch.cat([q.reshape(*lead, -1), k.reshape(*lead, -1),
                               v.reshape(*lead, -1)], dim=-1)
            return GDNInputs(mixed, z.reshape(*lead, self.hv, self.dv) if with_z else None,
                             b.reshape(*lead, self.hv), a.reshape(*lead, self.hv))
        z = self.in_proj_z(xn).view(*lead, self.hv, self.dv) if with_z else None
        return GDNInputs(self.in_proj_qkv(xn), z, self.in_proj_b(xn), self.in_proj_a(xn))

    def mix(self, inp: GDNInputs, conv_state: torch.Tensor | None,
            recurrent_state: torch.Tensor | None, *, chunked: bool = True,
            out_rows: torch.Tensor | None = None):
        """Conv, gates and delta rule over [B, T] rows.

        Returns (o [B, T, HV, Dv] in model dtype, conv_state [B, conv_dim, Kc−1],
        recurrent_state [B, HV, Dk, Dv] fp32). `None` states mean a fresh sequence.
        """
        bsz, t = inp.mixed.shape[:2]
        y, conv_state = causal_conv1d(inp.mixed, self.conv1d.weight.view(self.conv1d.weight.shape[0], -1),
                                      conv_state)
        key_dim = self.hk * self.dk
        q, k, v = y.split([key_dim, key_dim, self.hv * self.dv], dim=-1)
        q = q.reshape(bsz, t, self.hk, self.dk)
        k = k.reshape(bsz, t, self.hk, self.dk)
        v = v.reshape(bsz, t, self.hv, self.dv)
        beta = torch.sigmoid(inp.b)                                       # model dtype, as HF
        g = self.log_decay(inp.a)
        if chunked and t > 1:       # repeats the key heads itself, a block at a time
            o, recurrent_state = chunk_gated_delta_rule(q, k, v, g, beta, recurrent_state,
                                                        out_rows=out_rows)
        else:
            r = self.hv // self.hk
            if r > 1:
                q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
            o, recurrent_state = recurrent_gated_delta_rule(q, k, v, g, beta, recurrent_state)
        return o.to(inp.mixed.dtype), conv_state, recurrent_state

    def log_decay(self, a: torch.Tensor) -> torch.Tensor:
        """a [*, HV] decay logits -> g [*, HV] fp32, the log of each row's state decay."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o, z [*, HV, Dv] -> [*, h] (before the residual add)."""
        return self.out_proj(self.norm(o, z).reshape(*o.shape[:-2], -1))
