"""The filled rows' own upper-layer work, in the fill's precision.

A filled row in upper layer l costs the map x̂_l = A_l x_S + b_l, the layer's input norm
and its K/V projections (attention) or Gated DeltaNet input projections; nothing else of
the layer runs for it. That work is approximate from the start: x̂_l carries the map's
error (20-45% of the key norm on SmolLM2-135M, bench/ridgefill/map_probes.py), against a
bf16 rounding of 0.4%. So it may run in a lower precision than the exact rows:

    exact rows (tail, selected)    every layer in the model's dtype
    filled rows                    map, norm, K/V | GDN in-projections in `dtype`,
                                   cast back to the model's dtype for the cache and the
                                   Gated DeltaNet state sweep (which stays fp32)

On a CPU with bf16 products (AVX512-BF16 / AMX) those GEMMs run about 4x faster than fp32
(bench/ridgefill/ttft.py --fill-dtypes model,bfloat16). `dtype=None` keeps the model's
dtype: every call is then the model's own stage call, unchanged.

Only the submodules a filled row runs are copied (FILLED_ATTN_MODULES, FILLED_GDN_MODULES):
6.3 MiB in bf16 for SmolLM2-135M's 15 upper layers, against 25.3 MiB for whole mixers.
"""
from __future__ import annotations

import copy
import threading

import torch

from models.config import FULL_ATTENTION
from models.gdn import GDNInputs, map_inputs
from models.model import CausalLM

FILL_DTYPES = {"model": None, "bfloat16": torch.bfloat16}


def parse_fill_dtype(name: str) -> torch.dtype | None:
    """'model' | 'bfloat16' -> a dtype (None: the model's own)."""
    if name not in FILL_DTYPES:
        raise ValueError(f"fill dtype must be one of {sorted(FILL_DTYPES)}, got {name!r}")
    return FILL_DTYPES[name]


# the submodules a filled row's K/V (attention) or state inputs (Gated DeltaNet) read; the
# query, output and output-gate projections never run for a filled row and are not copied
FILLED_ATTN_MODULES = ("k_proj", "v_proj", "k_norm")
FILLED_GDN_MODULES = ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_b", "in_proj_a")


def _part(module: torch.nn.Module, keep: tuple[str, ...], dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `module` whose submodules named in `keep` are deep copies in `dtype` and
    whose other submodules, parameters and buffers are left out (a call that reaches one
    fails instead of running a full-size copy). The original is not touched."""
    part = copy.copy(module)
    part._modules = {name: (copy.deepcopy(m).to(dtype) if name in keep and m is not None else None)
                     for name, m in module._modules.items()}
    part._parameters, part._buffers = {}, {}
    return part


class FillLayers:
    """Per upper layer, the modules a filled row runs (input norm; attention K/V or GDN
    input projections, not the layer's other weights), copied to `dtype` on first use and
    kept. One per model and dtype, shared by concurrent prefills (the copies are built under
    a lock, then only read)."""

    def __init__(self, model: CausalLM, dtype: torch.dtype | None = None):
        self.model = model
        self.dtype = model.dtype if dtype is None else dtype
        self.lowered = self.dtype != model.dtype
        self._copies: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}
        self._lock = threading.Lock()

    def _layer(self, l: int) -> tuple[torch.nn.Module, torch.nn.Module]:
        with self._lock:
            if l not in self._copies:
                layer = self.model.layer(l)
                if layer.kind == FULL_ATTENTION:
                    block = _part(layer.self_attn, FILLED_ATTN_MODULES, self.dtype)
                else:
                    block = _part(layer.linear_attn, FILLED_GDN_MODULES, self.dtype)
                self._copies[l] = (copy.deepcopy(layer.input_layernorm).to(self.dtype), block)
            return self._copies[l]

    def key_value(self, l: int, x_hat: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """x̂ [F, h] of filled rows at `positions` -> k, v [F, KV, D] in the model's dtype."""
        m = self.model
        if not self.lowered:
            return m.attn_key_value(l, m.norm_in(l, x_hat.to(m.dtype)), positions)
        norm, attn = self._layer(l)
        cos, sin = m.rotary.cos_sin(positions, self.dtype)
        k, v = attn.key_value(norm(x_hat.to(self.dtype)), cos, sin, m.rotary)
        return k.to(m.dtype), v.to(m.dtype)

    def gdn_inputs(self, l: int, x_hat: torch.Tensor) -> GDNInputs:
        """x̂ [F, h] -> the rows' GDN inputs (no output gate: they only advance the state),
        in the model's dtype."""
        m = self.model
        if not self.lowered:
            return m.gdn_inputs(l, x_hat.to(m.dtype), with_z=False)
        norm, gdn = self._layer(l)
        inp = gdn.inputs(norm(x_hat.to(self.dtype)), with_z=False)
        return map_inputs(inp, lambda t: t.to(m.dtype))

    @property
    def copy_bytes(self) -> int:
        """Memory held by the lowered copies."""
        return sum(p.numel() * p.element_size() for pair in self._copies.values()
                   for mod in pair for p in mod.parameters())


__all__ = ["FILLED_ATTN_MODULES", "FILLED_GDN_MODULES", "FILL_DTYPES", "FillLayers",
           "parse_fill_dtype"]
