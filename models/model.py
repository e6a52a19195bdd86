"""The causal LM and its stage API.

Every service composes these stages instead of re-implementing layers:

    embed(ids) -> x
    per full-attention layer l:   attn_inputs(l, x, pos) -> AttnInputs(q, k, v, gate)
                                  attn_output(l, x, o, gate) -> h
    per linear-attention layer l: gdn_inputs(l, x) -> GDNInputs
                                  gdn_mix(l, inputs, conv_state, recurrent_state)
                                  gdn_output(l, x, o, z) -> h
    per layer l:                  mlp(l, h) -> x_next
    final(x) -> logits

The finer pieces (`norm_in`, `attn_query`, `attn_key_value`) exist for the disaggregated
decode path, where the query and the key/value are computed in different processes.
`forward` is the exact reference, built from the same stages.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from kernels.attention import get_backend
from models.attention import FullAttention
from models.config import FULL_ATTENTION, ModelConfig
from models.gdn import GatedDeltaNet, GDNInputs
from models.layers import (MLP, Linear, RMSNorm, SparseMoE, consolidate_int8, int8_copy,
                           mark_int8, project)
from models.rope import Rotary


class AttnInputs(NamedTuple):
    q: torch.Tensor              # [*, H, D]   normed (QK-norm) and rotated
    k: torch.Tensor              # [*, KV, D]  normed and rotated, as cached
    v: torch.Tensor              # [*, KV, D]
    gate: torch.Tensor | None    # [*, H·D]    output gate (gated families) or None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.kind = cfg.layer_types[index]
        eps, zc = cfg.rms_norm_eps, cfg.zero_centered_norm
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, zc)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, zc)
        if self.kind == FULL_ATTENTION:
            self.self_attn = FullAttention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg)
        if cfg.uses_moe(index):
            self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                 cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size,
                                 cfg.norm_topk_prob)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centered_norm)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.rotary_dim)
        self._layers = list(self.model.layers)   # plain list: no module lookup per stage call

    # ---- helpers -------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def layer(self, l: int) -> DecoderLayer:
        return self._layers[l]

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings \
            else self.lm_head.weight

    def fuse_projections(self) -> "CausalLM":
        """Store each full-attention layer's q/k/v and each dense MLP's gate/up as one matrix
        (their modules keep views of it), so a decode step runs 2 products per layer fewer.
        Outputs are unchanged: the same rows multiply the same input."""
        for layer in self.model.layers:
            if layer.kind == FULL_ATTENTION:
                layer.self_attn.fuse()
            if isinstance(layer.mlp, MLP):
                layer.mlp.fuse()
        return self

    def quantize(self, method: str | None, *, prompts: bool = False) -> "CausalLM":
        """`int8`: int8 weights for the decode-sized products of every projection and the
        LM head (`layers.mark_int8`; on AVX512-VNNI the activations too, per 32-column
        group); prompts keep the weights. The int8 copies the
        engine's decode step reads (fused q/k/v and gate/up, o, down, the head) are made
        here, the rest (the Q-First split's separate views) on first use. `prompts`: every
        product reads the int8 copy, prompts too (an eval's strict bound: the scored losses
        then see int8 weights). None: no change."""
        if method is None:
            return self
        if method != "int8":
            raise ValueError(f"unknown quantization {method!r}; choose from ['int8']")
        mark = lambda w: mark_int8(w, prompts=prompts)  # noqa: E731
        head = self.lm_head_weight()
        mark(head)
        used = [head]
        for layer in self.model.layers:
            router = getattr(layer.mlp, "gate", None)
            for mod in layer.modules():
                if isinstance(mod, nn.Linear) and mod is not router:
                    mark(mod.weight)
            for fused in (getattr(getattr(layer, "self_attn", None), "qkv", None),
                          getattr(layer.mlp, "gate_up", None)):
                if fused is not None:       # the fused matrix and its k/v (or up) rows
                    mark(fused.weight)
                    mark(fused.rest[0])
            if layer.kind == FULL_ATTENTION:    # in the order a decode step reads them
                attn = layer.self_attn
                used += [attn.qkv.weight, attn.o_proj.weight] if attn.qkv is not None else \
                    [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                     attn.o_proj.weight]
            if isinstance(layer.mlp, MLP):
                mlp = layer.mlp
                used += [mlp.gate_up.weight, mlp.down_proj.weight] if mlp.gate_up is not None \
                    else [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        built = [w for w in used if w.dim() == 2 and w.numel()]  # not a member's placeholders
        for w in built:
            int8_copy(w)
        consolidate_int8(built[1:] + built[:1])         # in step order: the head comes last
        return self

    # ---- stages --------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def norm_in(self, l: int, x: torch.Tensor) -> torch.Tensor:
        return self.layer(l).input_layernorm(x)

    def attn_query(self, l: int, xn: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.rotary.cos_sin(positions, xn.dtype)
        return self.layer(l).self_attn.query(xn, cos, sin, self.rotary)

    def attn_key_value(self, l: int, xn: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.rotary.cos_sin(positions, xn.dtype)
        return self.layer(l).self_attn.key_value(xn, cos, sin, self.rotary)

    def query_source(self, l: int, x: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        """What layer l's query reads. Standard wiring: the layer input x. Q-first wiring
        (seed 003, §6): u, the input of the previous layer's feed-forward, so the cache side
        can form q before the pool has run that feed-forward; layer 0 is exempt."""
        if self.config.wiring == "qfirst" and l > 0 and u is not None:
            return u
        return x

    def attn_inputs(self, l: int, x: torch.Tensor, positions: torch.Tensor,
                    u: torch.Tensor | None = None) -> AttnInputs:
        """x [*, h] residual stream (u: the previous feed-forward's input, read by the query
        under q-first wiring), positions [*] -> q, k, v, gate."""
        xn = self.norm_in(l, x)
        cos, sin = self.rotary.cos_sin(positions, xn.dtype)
        attn = self.layer(l).self_attn
        src = self.query_source(l, x, u)
        if src is x:
            q, gate, k, v = attn.project(xn, cos, sin, self.rotary)
            return AttnInputs(q, k, v, gate)
        q, gate = attn.query(self.norm_in(l, src), cos, sin, self.rotary)
        k, v = attn.key_value(xn, cos, sin, self.rotary)
        return AttnInputs(q, k, v, gate)

    def attn_output(self, l: int, x: torch.Tensor, o: torch.Tensor,
                    gate: torch.Tensor | None) -> torch.Tensor:
        """x [*, h], o [*, H, D] -> h = x + Wo(o [* sigmoid(gate)])."""
        return x + self.layer(l).self_attn.output(o.to(x.dtype), gate)

    def gdn_inputs(self, l: int, x: torch.Tensor, with_z: bool = True) -> GDNInputs:
        return self.layer(l).linear_attn.inputs(self.norm_in(l, x), with_z)

    def gdn_mix(self, l: int, inp: GDNInputs, conv_state=None, recurrent_state=None, *,
                chunked: bool = True, out_rows: torch.Tensor | None = None):
        return self.layer(l).linear_attn.mix(inp, conv_state, recurrent_state, chunked=chunked,
                                             out_rows=out_rows)

    def gdn_output(self, l: int, x: torch.Tensor, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return x + self.layer(l).linear_attn.output(o, z)

    def mlp(self, l: int, h: torch.Tensor) -> torch.Tensor:
        layer = self.layer(l)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x)

    def final(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.final_norm(x), self.lm_head_weight())

    # ---- exact reference -----------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_backend: str | None = None,
                last_n: int | None = None) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab] (or of the last `last_n` positions);
        exact, no cache."""
        backend = get_backend(attention_backend, self.device)
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        x, h = self.embed(input_ids), None
        for l, layer in enumerate(self.model.layers):
            if layer.kind == FULL_ATTENTION:
                a = self.attn_inputs(l, x, positions, u=h)
                o, _ = backend.attention_lse(a.q, a.k, a.v, causal=True)
                h = self.attn_output(l, x, o, a.gate)
            else:
                inp = self.gdn_inputs(l, x)
                o, _, _ = self.gdn_mix(l, inp)
                h = self.gdn_output(l, x, o, inp.z)
            x = self.mlp(l, h)
        return self.final(x if last_n is None else x[:, -last_n:])
