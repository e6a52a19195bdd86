"""Tail-Replay (seed 001): rebuild the linear-attention states of a cache hit from its tail.

Groups. Each full-attention (FA) layer and the Gated DeltaNet (GDN) layers that follow it,
up to the next FA layer, form a group. Layers before the first FA layer form a leading
group whose input is the token embedding, which the token ids give back exactly, so it
needs no stored hidden. Groups without a GDN layer have nothing to replay.

    layers   L0 L1 L2 F3 | L4 L5 L6 F7 | L8
    groups   [L0 L1 L2]  | [F3: L4 L5 L6] [F7: L8]
    input    embed(ids)  | hidden after F3 | hidden after F7

The FA output hidden of a group is the residual stream leaving the FA layer, after its
feed-forward: exactly the input of the group's first GDN layer (the paper's condition that
confines replay error within a group). The cache stores it per token for every group that
has one, in layer order (`hidden_layers`), as `hidden [G, N, H]`.

Replay of a hit on `m` tokens: each group's last `k` inputs run through its GDN layers from
zero conv and recurrent states; the states left after row m−1 approximate the full-prefill
states. The first GDN layer's conv state (its last Kc−1 pre-conv inputs) is exact whenever
k ≥ Kc−1, so `replay_len` never goes below that. With `ffn_skip` the group's last layer runs
only its delta-rule state update (neither its output projection nor its feed-forward: the
next group starts from its own cached hidden). `replay_ratio = 0` is the paper's zero-only
baseline: FA KV reused, every GDN state zero.

`prompt_rows` and `continue_prefill` are the monolithic references: what the cache stores
for a prompt, and the suffix prefill after a hit. The engine composes the same stages; an
evaluation arm can use these three functions without an engine.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from kernels.attention import get_backend
from models.config import FULL_ATTENTION, ModelConfig
from models.gdn import GDNInputs, map_inputs
from models.model import CausalLM


class ReplayError(ValueError):
    """A replay setting out of range; carries the offending value."""

    def __init__(self, name: str, value, expected: str):
        super().__init__(f"{name} must be {expected}, got {value!r}")
        self.name, self.value = name, value


@dataclass(frozen=True)
class TailReplayConfig:
    replay_ratio: float = 0.1   # r: replay the last ceil(r·m) rows of an m-token hit; 0: zero-only
    overlap: bool = True        # write the FA KV on a worker thread while replaying
    ffn_skip: bool = True       # a group's last layer runs only its state update
    # replay through CUDA graphs at bucketed tail lengths (`replay_graph.py`), CUDA only;
    # SPLITSTACK_REPLAY_GRAPHS=1 turns it on for engines that take the default
    cuda_graphs: bool = field(
        default_factory=lambda: os.environ.get("SPLITSTACK_REPLAY_GRAPHS", "0") == "1")

    def __post_init__(self):
        check_ratio(self.replay_ratio)


def check_ratio(r) -> float:
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
        raise ReplayError("replay_ratio", r, "a number in [0, 1]")
    return float(r)


@dataclass(frozen=True)
class Group:
    fa_layer: int | None               # None: the leading group, fed by the embeddings
    linear_layers: tuple[int, ...]     # its GDN layers, in order


def groups(cfg: ModelConfig) -> list[Group]:
    """The groups that have GDN layers, in layer order."""
    out, fa, run = [], None, []
    for l, kind in enumerate(cfg.layer_types):
        if kind == FULL_ATTENTION:
            if run:
                out.append(Group(fa, tuple(run)))
            fa, run = l, []
        else:
            run.append(l)
    if run:
        out.append(Group(fa, tuple(run)))
    return out


def hidden_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """FA layers whose output hidden the cache stores: row g of `hidden [G, N, H]`."""
    return tuple(g.fa_layer for g in groups(cfg) if g.fa_layer is not None)


def replay_len(m: int, ratio: float, conv_kernel: int) -> int:
    """k = ceil(r·m), at least Kc−1 (exact conv state), at most m; 0 when r = 0."""
    if ratio <= 0 or m <= 0:
        return 0
    return min(m, max(math.ceil(ratio * m - 1e-9), conv_kernel - 1))


@dataclass
class GDNStates:
    """Per GDN layer (in `cfg.linear_attention_layers` order, as `CacheStorage` holds them)."""
    conv: torch.Tensor        # [Lg, conv_dim, Kc−1] model dtype
    recurrent: torch.Tensor   # [Lg, HV, Dk, Dv] fp32


def zero_states(model: CausalLM) -> GDNStates:
    cfg, dev = model.config, model.device
    n = len(cfg.linear_attention_layers)
    return GDNStates(
        torch.zeros(n, cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=model.dtype,
                    device=dev),
        torch.zeros(n, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                    cfg.linear_value_head_dim, dtype=torch.float32, device=dev))


@torch.inference_mode()
def tail_replay(model: CausalLM, tail_ids: torch.Tensor, tail_hidden: torch.Tensor | None,
                ffn_skip: bool = True, row_mask: torch.Tensor | None = None) -> GDNStates:
    """tail_ids [k] (the hit's last k tokens), tail_hidden [G, k, H] (their cached FA output
    hiddens; None when G = 0) -> the GDN states after the tail, each group from zero.
    `row_mask` [k, 1] (1 keep, 0 drop) zeroes dropped rows' embeddings: leading rows that
    are zero everywhere (hiddens too) leave every state as without them (`replay_graph`)."""
    cfg = model.config
    states = zero_states(model)
    if tail_ids.numel() == 0:
        return states
    index = {l: i for i, l in enumerate(cfg.linear_attention_layers)}
    g = 0
    for group in groups(cfg):
        if group.fa_layer is None:
            x = model.embed(tail_ids.to(model.device))
            if row_mask is not None:
                x = x * row_mask
        else:
            x = tail_hidden[g].to(model.device, model.dtype)
            g += 1
        for j, l in enumerate(group.linear_layers):
            last = ffn_skip and j == len(group.linear_layers) - 1   # its output is not used
            inp = model.gdn_inputs(l, x, with_z=not last)                 # rows [k, *]
            o, conv, rec = model.gdn_mix(l, map_inputs(inp, lambda t: t[None]))
            states.conv[index[l]], states.recurrent[index[l]] = conv[0], rec[0]
            if last:
                break
            x = model.mlp(l, model.gdn_output(l, x, o[0], inp.z))
    return states


@torch.inference_mode()
def prompt_rows(model: CausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference of what the cache stores for a prompt, from one exact forward:
    ids [N] -> kv [F, 2, N, KV, D], hidden [G, N, H] (None when G = 0)."""
    backend = get_backend(None, model.device)
    ids = ids.to(model.device)
    positions = torch.arange(len(ids), device=model.device)
    keep = hidden_layers(model.config)
    x, h, kv, hid = model.embed(ids), None, [], []
    for l, layer in enumerate(model.model.layers):
        if layer.kind == FULL_ATTENTION:
            a = model.attn_inputs(l, x, positions, u=h)
            kv.append(torch.stack([a.k, a.v]))
            o, _ = backend.attention_lse(a.q[None], a.k[None], a.v[None], causal=True)
            h = model.attn_output(l, x, o[0], a.gate)
        else:
            inp = model.gdn_inputs(l, x)
            o, _, _ = model.gdn_mix(l, GDNInputs(*(t[None] for t in inp)))
            h = model.gdn_output(l, x, o[0], inp.z)
        x = model.mlp(l, h)
        if l in keep:
            hid.append(x)
    return torch.stack(kv), torch.stack(hid) if hid else None


@torch.inference_mode()
def continue_prefill(model: CausalLM, ids: torch.Tensor, kv: torch.Tensor,
                     states: GDNStates | None, *, return_cache: bool = False):
    """Reference suffix prefill after a hit: ids [N] whose first m rows are cached as
    kv [F, 2, m, KV, D] (and, for hybrids, `states` at row m−1) -> logits [N − m, vocab].
    With `return_cache`, also ({FA layer: (k [N, KV, D], v)}, states after row N−1)."""
    backend = get_backend(None, model.device)
    m = kv.shape[2]
    ids = ids.to(model.device)
    positions = torch.arange(m, len(ids), device=model.device)
    index = {l: i for i, l in enumerate(model.config.linear_attention_layers)}
    fa = {l: i for i, l in enumerate(model.config.full_attention_layers)}
    out = GDNStates(states.conv.clone(), states.recurrent.clone()) if states is not None \
        else None
    cache = {}
    x, h = model.embed(ids[m:]), None
    for l, layer in enumerate(model.model.layers):
        if layer.kind == FULL_ATTENTION:
            a = model.attn_inputs(l, x, positions, u=h)
            k = torch.cat([kv[fa[l], 0].to(a.k), a.k])
            v = torch.cat([kv[fa[l], 1].to(a.v), a.v])
            cache[l] = (k, v)
            o, _ = backend.attention_lse(a.q[None], k[None], v[None], causal=True)
            h = model.attn_output(l, x, o[0], a.gate)
        else:
            i = index[l]
            inp = model.gdn_inputs(l, x)
            o, conv, rec = model.gdn_mix(l, GDNInputs(*(t[None] for t in inp)),
                                         states.conv[i][None], states.recurrent[i][None])
            out.conv[i], out.recurrent[i] = conv[0], rec[0]
            h = model.gdn_output(l, x, o[0], inp.z)
        x = model.mlp(l, h)
    logits = model.final(x).float()
    return (logits, cache, out) if return_cache else logits
