"""SmolLM2 (Llama) -> Qwen3.5 hybrid: the layout, the weight conversion and the calibrated init.

Layout: every fourth layer keeps full attention, at a chosen phase: layer i is full
attention iff i % 4 == fa_phase. Qwen3.5's own `full_attention_interval` rule is phase 3
(3, 7, ..., 27); phase 2 (2, 6, ..., 26) keeps layers 18 and 22, where SmolLM2's heads that
attend from the answer to the needle sit. Either way 7 layers keep softmax attention and
23 become Gated DeltaNet; `layer_types` is written out in config.json.

Conversion (`base_state`, a fixed function of the parent's weights):
- every RMSNorm is zero-centred in Qwen3.5, so its weight is stored as w − 1;
- full attention: q_proj rows become per-head [q_h | gate_h] with zero gate rows, o_proj is
  doubled to undo sigmoid(0) = 0.5; rotary stays full (partial_rotary_factor 1.0);
- GDN: one head per parent query head (HK = HV = 9, Dk = Dv = 64), so in_proj_qkv is
  [q_proj; k_proj; v_proj] with each KV head repeated for its 3 query heads (GQA unrolled)
  and out_proj is o_proj.

Calibrated init (`calibrate`, on a few windows of calibration text):
- attention: Qwen3.5 RMS-normalises q and k per head. SmolLM2's sink token (position 0) has
  a key of about half the typical norm, so plain QK-norm moves most attention mass and the
  layer output is lost (relative error 0.7–1.4). Instead one rotary pair (the one carrying the
  least q·k energy) is given up as *ballast*: its q/k rows are refitted by least squares so
  that every head's q and k have a near-constant norm (b = sqrt(C² − |rest|²)), its q_norm
  weight is zeroed so it never enters q·k, and the remaining norm weights are the
  least-squares w_d = Σ raw_d n_d / Σ n_d². Relative output error: 0.006–0.045.
- GDN conv: identity on the last tap, scaled so q / k / v enter silu at RMS 0.5 (nearly
  linear; q and k are L2-normalised and the output is RMS-normed, so the scale is free);
- GDN decay: g = −1/τ_h with τ_h the replaced head's mean attention distance (sink excluded);
  in_proj_a = 0, dt_bias = softplus⁻¹(1); in_proj_b = 0 (β = ½);
- GDN z: ridge fit of silu⁻¹(RMS of the replaced head's attention output), so silu(z) restores
  the per-token magnitude the output RMSNorm removes; norm.weight = 1.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from models.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from models.model import CausalLM

INTERVAL = 4
FA_PHASE = 3
CONV_RMS = 0.5


def layer_types(n_layers: int, fa_phase: int = FA_PHASE,
                fa_layers: list[int] | tuple[int, ...] | None = None) -> list[str]:
    """Layer i keeps full attention iff i % 4 == fa_phase, or, given `fa_layers`, iff i is
    one of them (any set: `retrieval_heads.choose_layers` picks one from the parent)."""
    if fa_layers is not None:
        chosen = set(fa_layers)
        if not chosen or min(chosen) < 0 or max(chosen) >= n_layers:
            raise ValueError(f"fa_layers must name layers in [0, {n_layers}), got {fa_layers}")
        return [FULL_ATTENTION if i in chosen else LINEAR_ATTENTION for i in range(n_layers)]
    if not 0 <= fa_phase < INTERVAL:
        raise ValueError(f"fa_phase must be in [0, {INTERVAL}), got {fa_phase}")
    return [FULL_ATTENTION if i % INTERVAL == fa_phase else LINEAR_ATTENTION
            for i in range(n_layers)]


def hybrid_config(parent_dir: Path, fa_phase: int = FA_PHASE,
                  fa_layers: list[int] | tuple[int, ...] | None = None) -> dict:
    p = json.loads((Path(parent_dir) / "config.json").read_text())
    parent = ModelConfig.from_hf(p)
    if parent.model_type != "llama" or parent.rope.rope_type != "default":
        raise ValueError(f"hybrid derivation starts from a llama checkpoint with plain rope, "
                         f"got {parent.model_type!r} / {parent.rope.rope_type!r}")
    half = parent.head_dim // 2                  # mRoPE sections; text-only, any split works
    a = -(-half // 3)
    b = -(-(half - a) // 2)
    n = parent.num_hidden_layers
    return {
        "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
        **{k: p[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                             "num_hidden_layers", "num_attention_heads",
                             "num_key_value_heads", "rms_norm_eps",
                             "max_position_embeddings", "tie_word_embeddings",
                             "bos_token_id", "eos_token_id")},
        "head_dim": parent.head_dim, "hidden_act": "silu", "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": parent.rope.theta,
                            "partial_rotary_factor": 1.0, "mrope_section": [a, b, half - a - b],
                            "mrope_interleaved": True},
        "layer_types": layer_types(n, fa_phase, fa_layers),
        "linear_num_key_heads": parent.num_attention_heads,
        "linear_num_value_heads": parent.num_attention_heads,
        "linear_key_head_dim": parent.head_dim, "linear_value_head_dim": parent.head_dim,
        "linear_conv_kernel_dim": 4, "torch_dtype": "float32",
    }


def base_state(parent: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The part of the child that is a fixed function of the parent's weights."""
    h, H, KV, D = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                   cfg.head_dim)
    out = {}
    for name, t in parent.items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            out[name] = t - 1.0
        elif ".self_attn." not in name and name != "lm_head.weight":
            out[name] = t
    for l, kind in enumerate(cfg.layer_types):
        src = f"model.layers.{l}.self_attn."
        q, k, v, o = (parent[f"{src}{n}_proj.weight"] for n in "qkvo")
        if kind == FULL_ATTENTION:
            out[src + "q_proj.weight"] = torch.cat(
                [q.view(H, D, h), torch.zeros(H, D, h)], 1).reshape(2 * H * D, h)
            out[src + "k_proj.weight"], out[src + "v_proj.weight"] = k, v
            out[src + "o_proj.weight"] = 2.0 * o
        else:
            unroll = lambda w: w.view(KV, D, h).repeat_interleave(H // KV, 0).reshape(H * D, h)
            dst = f"model.layers.{l}.linear_attn."
            out[dst + "in_proj_qkv.weight"] = torch.cat([q, unroll(k), unroll(v)])
            out[dst + "out_proj.weight"] = o
    return out


MASKED = -1e9      # a causal mask that keeps log-probabilities finite (KL terms stay 0·finite)


def attention_logprobs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Causal attention log-probabilities [H, T, T] of one sequence: q [1, T, H, D] and
    k [1, T, KV, D] as `attn_inputs` gives them (normed, rotated), grouped-query heads
    expanded, scaled by D^-1/2 as the attention kernel does."""
    _, t, h, d = q.shape
    kh = k[0].transpose(0, 1).repeat_interleave(h // k.shape[2], 0)           # [H, T, D]
    scores = q[0].transpose(0, 1) @ kh.transpose(1, 2) * d ** -0.5
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    return torch.log_softmax(scores.masked_fill(future, MASKED), -1)


def mixer(model: CausalLM, l: int, x: torch.Tensor, pos: torch.Tensor,
          u: torch.Tensor | None = None, attn: dict | None = None) -> torch.Tensor:
    """Differentiable token-mixer output of layer l (before the residual add); u is the
    previous feed-forward's input, which the query reads under q-first wiring. Where
    `attn` has the key l and the layer is full attention, attn[l] becomes its (q, k), from
    which `attention_logprobs` forms the attention distributions."""
    layer = model.layer(l)
    if layer.kind == FULL_ATTENTION:
        a = model.attn_inputs(l, x, pos, u=u)
        if attn is not None and l in attn:
            attn[l] = (a.q, a.k)
        o = F.scaled_dot_product_attention(a.q.transpose(1, 2), a.k.transpose(1, 2),
                                           a.v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True).transpose(1, 2)
        return layer.self_attn.output(o, a.gate)
    inp = model.gdn_inputs(l, x)
    o, _, _ = model.gdn_mix(l, inp)
    return layer.linear_attn.output(o, inp.z)


def train_logits(model: CausalLM, ids: torch.Tensor, trace: list | None = None,
                 checkpoint: bool = False, final: bool = True, attn: dict | None = None):
    """Differentiable forward under the model's wiring; `trace` collects (layer input, mixer
    output) per layer; `attn` ({layer: None, ...}) gets those attention layers' (q, k)
    (`mixer`). `checkpoint` keeps only each layer's inputs for the backward pass and
    recomputes the rest (gradient checkpointing: the same values, far less memory at long
    sequences; not with `attn`, which would hold tensors from inside the recomputed
    layers); `final=False` returns the last hidden state instead of the logits."""
    if checkpoint and attn:
        raise ValueError("attention transfer reads q and k inside the layers: not with "
                         "gradient checkpointing")
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    x, h = model.embed(ids), None

    def layer(l, x, h):
        m = mixer(model, l, x, pos, u=h, attn=attn)
        h = x + m
        return model.mlp(l, h), h, m

    for l in range(model.config.num_hidden_layers):
        if checkpoint and torch.is_grad_enabled():
            x_new, h, m = torch.utils.checkpoint.checkpoint(layer, l, x, h, use_reentrant=False)
        else:
            x_new, h, m = layer(l, x, h)
        if trace is not None:
            trace.append((x, m))
        x = x_new
    return model.final(x) if final else x


def _silu_inverse(y: torch.Tensor) -> torch.Tensor:
    lo, hi = torch.zeros_like(y), torch.full_like(y, 30.0)
    for _ in range(50):
        mid = (lo + hi) / 2
        below = F.silu(mid) < y
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    return (lo + hi) / 2


def _ridge(xtx: torch.Tensor, xty: torch.Tensor, lam: float) -> torch.Tensor:
    eye = torch.eye(xtx.shape[0])
    return torch.linalg.solve(xtx + lam * xtx.diagonal().mean() * eye, xty).T


def _ballast(xn: torch.Tensor, w: torch.Tensor, heads: int, dims: list[int]) -> torch.Tensor:
    """w [heads·D, h] with rows `dims` of each head refitted so that every head's output
    vector has a near-constant norm C (C² = 1.1 × the 99.9th percentile of the rest's)."""
    d = w.shape[0] // heads
    rest = (xn @ w.T).view(-1, heads, d)
    rest[..., dims] = 0
    n2 = rest.pow(2).sum(-1)                                              # [N, heads]
    target = (1.1 * torch.quantile(n2.flatten(), 0.999) - n2).clamp_min(0).sqrt()
    w = w.clone().view(heads, d, -1)
    w[:, dims[0]], w[:, dims[1]] = _ridge(xn.T @ xn, xn.T @ target, 1e-4), 0.0
    return w.view(heads * d, -1)


def _norm_weight(raw: torch.Tensor, src: torch.Tensor, eps: float) -> torch.Tensor:
    """Least-squares per-channel weight mapping RMSNorm(src) onto raw ([N, D] each)."""
    n = src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + eps)
    return (raw * n).sum(0) / n.pow(2).sum(0)


def fit_ballast_qk(wq: torch.Tensor, wk: torch.Tensor, xn: torch.Tensor,
                   cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor, list[int]]:
    """Per-head QK RMSNorm that reproduces the parent's q·k (ballast pair).

    xn [N, h] the parent's attention inputs; wq [H·D, h], wk [KV·D, h] its projections.
    Returns the refitted wq, wk (only the ballast rows `dims` of each head change), the plain
    (not zero-centred) q_norm / k_norm weights [D] and `dims`, the rotary pair [p, p + D/2]
    of the half-split layout (`models.rope`) that carries the least q·k energy."""
    H, KV, D, eps = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                     cfg.rms_norm_eps)
    q, k = (xn @ wq.T).view(-1, H, D), (xn @ wk.T).view(-1, KV, D)
    energy = (q.pow(2).mean((0, 1)).view(2, D // 2).sum(0)
              * k.pow(2).mean((0, 1)).view(2, D // 2).sum(0))
    pair = int(energy.argmin())
    dims = [pair, pair + D // 2]
    wq, wk = _ballast(xn, wq, H, dims), _ballast(xn, wk, KV, dims)
    q_norm = _norm_weight(q.reshape(-1, D), (xn @ wq.T).view(-1, D), eps)
    k_norm = _norm_weight(k.reshape(-1, D), (xn @ wk.T).view(-1, D), eps)
    q_norm[dims], k_norm[dims] = 0.0, 1.0
    return wq, wk, q_norm, k_norm, dims


def fit_attention(attn, xn: torch.Tensor, cfg: ModelConfig, prefix: str) -> dict:
    """Gated, QK-normed attention initialised to reproduce the parent's (ballast pair)."""
    H, D, h = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    wq, wk, q_norm, k_norm, _ = fit_ballast_qk(attn.q_proj.weight, attn.k_proj.weight, xn, cfg)
    return {prefix + "q_proj.weight": torch.cat([wq.view(H, D, h), torch.zeros(H, D, h)],
                                                1).reshape(2 * H * D, h),
            prefix + "k_proj.weight": wk,
            prefix + "q_norm.weight": q_norm - 1.0, prefix + "k_norm.weight": k_norm - 1.0}


def fit_gdn(attn, xn: torch.Tensor, span: torch.Tensor, head_rms: torch.Tensor,
            cfg: ModelConfig, prefix: str) -> dict:
    """xn [N, h] inputs; span [H] mean attention distance; head_rms [N, H] output RMS."""
    H, D, h = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    rms = torch.stack([p(xn).pow(2).mean().sqrt() for p in
                       (attn.q_proj, attn.k_proj, attn.v_proj)])
    taps = torch.zeros(cfg.gdn_conv_dim, 1, cfg.linear_conv_kernel_dim)
    taps[:, 0, -1] = (CONV_RMS / rms).repeat_interleave(H * D)
    wz = _ridge(xn.T @ xn, xn.T @ _silu_inverse(head_rms), 1e-3)               # [H, h]
    return {prefix + "conv1d.weight": taps,
            prefix + "in_proj_z.weight": wz.repeat_interleave(D, 0).contiguous(),
            prefix + "in_proj_a.weight": torch.zeros(H, h),
            prefix + "in_proj_b.weight": torch.zeros(H, h),
            prefix + "A_log": -span.clamp(1.0, 4096.0).log(),
            prefix + "dt_bias": torch.full((H,), math.log(math.e - 1.0)),
            prefix + "norm.weight": torch.ones(D)}


@torch.no_grad()
def calibrate(parent: CausalLM, cfg: ModelConfig, batches: list[torch.Tensor]) -> dict:
    """Initial values of the child tensors that `base_state` leaves to calibration."""
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    xns = {l: [] for l in range(cfg.num_hidden_layers)}
    spans = {l: 0.0 for l in cfg.linear_attention_layers}
    head_rms = {l: [] for l in cfg.linear_attention_layers}
    for ids in batches:
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        dist = (pos[0, :, None] - pos[0, None, :]).float()
        x = parent.embed(ids)
        for l in range(cfg.num_hidden_layers):
            xns[l].append(parent.norm_in(l, x)[0])
            if l in spans:
                a = parent.attn_inputs(l, x, pos)
                q, k = a.q[0].transpose(0, 1), a.k[0].repeat_interleave(H // KV, 1).transpose(0, 1)
                p = ((q @ k.transpose(1, 2)) / math.sqrt(D)).masked_fill(dist < 0, -math.inf)
                p = p.softmax(-1)[:, 32:, 1:]                      # skip the sink (key 0)
                p = p / p.sum(-1, keepdim=True)
                spans[l] = spans[l] + (p * dist[32:, 1:]).sum(-1).mean(-1) / len(batches)
                o = F.scaled_dot_product_attention(a.q.transpose(1, 2), a.k.transpose(1, 2),
                                                   a.v.transpose(1, 2), is_causal=True,
                                                   enable_gqa=True)[0]          # [H, T, D]
                head_rms[l].append(o.pow(2).mean(-1).sqrt().T)
            x = parent.mlp(l, x + mixer(parent, l, x, pos))
    init = {}
    for l, kind in enumerate(cfg.layer_types):
        attn, xn = parent.layer(l).self_attn, torch.cat(xns[l])
        if kind == FULL_ATTENTION:
            init.update(fit_attention(attn, xn, cfg, f"model.layers.{l}.self_attn."))
        else:
            init.update(fit_gdn(attn, xn, spans[l], torch.cat(head_rms[l]), cfg,
                                f"model.layers.{l}.linear_attn."))
    return init
