"""Model configuration: one frozen dataclass for every supported family.

`ModelConfig.from_hf` normalises a Hugging Face `config.json` dict (either the old
`rope_theta` / `rope_scaling` form or the transformers-5 `rope_parameters` form, and
Qwen3.5's nested `text_config`) into the fields the layers read. Family differences are
data here (`qk_norm`, `zero_centered_norm`, `attn_output_gate`, `gdn_layout`,
`layer_types`), never `if model_type` inside the layers.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config.json that splitstack cannot serve; carries the offending field."""


FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# model_type -> (qk_norm, zero_centered_norm, attn_output_gate, gdn_layout)
_FAMILIES = {
    "llama": (False, False, False, None),
    "qwen3": (True, False, False, None),
    "qwen3_next": (True, True, True, "grouped"),
    "qwen3_5_text": (True, True, True, "flat"),
    "qwen3_5_moe_text": (True, True, True, "flat"),
}


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def __post_init__(self):
        if self.rope_type not in ("default", "llama3"):
            raise ConfigError(f"unsupported rope_type {self.rope_type!r}")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    layer_types: tuple[str, ...]
    qk_norm: bool = False
    zero_centered_norm: bool = False
    attn_output_gate: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # Gated DeltaNet (linear_attention layers)
    gdn_layout: str | None = None          # "grouped" (Qwen3-Next) | "flat" (Qwen3.5)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # splitstack-specific: which query read point the checkpoint was trained for
    wiring: str = "standard"
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for "
                              f"{self.num_hidden_layers} layers")
        bad = set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}
        if bad:
            raise ConfigError(f"unsupported layer_types {sorted(bad)}")
        if LINEAR_ATTENTION in self.layer_types:
            if self.gdn_layout not in ("grouped", "flat"):
                raise ConfigError(f"model_type {self.model_type!r} has no Gated DeltaNet layout")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.wiring not in ("standard", "qfirst"):
            raise ConfigError(f"unknown wiring {self.wiring!r}")

    # ---- derived sizes -------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    def uses_moe(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    # ---- parsing -------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        with open(Path(path) / "config.json") as f:
            return cls.from_hf(json.load(f))

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        if cfg.get("model_type") in ("qwen3_5", "qwen3_5_moe") and "text_config" in cfg:
            text = dict(cfg["text_config"])
            text.setdefault("model_type", cfg["model_type"] + "_text")
            for key in ("tie_word_embeddings", "splitstack_wiring"):
                if key in cfg and key not in text:
                    text[key] = cfg[key]
            cfg = text
        model_type = cfg.get("model_type")
        if model_type not in _FAMILIES:
            raise ConfigError(f"unsupported model_type {model_type!r}; "
                              f"supported: {sorted(_FAMILIES)}")
        qk_norm, zero_centered, gate, gdn_layout = _FAMILIES[model_type]
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        default_head_dim = 128 if model_type == "qwen3" else hidden // heads
        if model_type.startswith("qwen3_5") or model_type == "qwen3_next":
            default_head_dim = 256
        head_dim = cfg.get("head_dim") or default_head_dim
        n_layers = cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            if gdn_layout is not None:
                interval = cfg.get("full_attention_interval", 4)
                layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                               for i in range(n_layers)]
            else:
                layer_types = [FULL_ATTENTION] * n_layers
        layer_types = tuple(layer_types)
        if gdn_layout is None and any(t != FULL_ATTENTION for t in layer_types):
            raise ConfigError(f"model_type {model_type!r} supports only full_attention layers "
                              f"(sliding windows are not implemented): {set(layer_types)}")
        max_pos = cfg.get("max_position_embeddings", 2048)
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope=_parse_rope(cfg, model_type, max_pos),
            layer_types=layer_types,
            qk_norm=qk_norm,
            zero_centered_norm=zero_centered,
            attn_output_gate=gate,
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            gdn_layout=gdn_layout,
            linear_num_key_heads=cfg.get("linear_num_key_heads", 16 if gdn_layout else 0),
            linear_num_value_heads=cfg.get("linear_num_value_heads", 32 if gdn_layout else 0),
            linear_key_head_dim=cfg.get("linear_key_head_dim", 128 if gdn_layout else 0),
            linear_value_head_dim=cfg.get("linear_value_head_dim", 128 if gdn_layout else 0),
            linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
            num_experts=(cfg.get("num_experts", 0) or 0) if model_type in (
                "qwen3_next", "qwen3_5_moe_text") else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0) or 0,
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) or 0,
            norm_topk_prob=(bool(cfg.get("norm_topk_prob", True))
                            if model_type == "qwen3_next" else True),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers", ()) or ()),
            wiring=cfg.get("splitstack_wiring", "standard"),
            raw=dict(cfg),
        )


def _parse_rope(cfg: dict, model_type: str, max_pos: int) -> RopeConfig:
    """Fold the old (`rope_theta`, `rope_scaling`) and new (`rope_parameters`) forms."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    hybrid = model_type in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
    partial = params.get("partial_rotary_factor",
                         cfg.get("partial_rotary_factor", 0.25 if hybrid else 1.0))
    rope_type = params.get("rope_type", "default")
    if rope_type == "llama3":
        original = params.get("original_max_position_embeddings") or max_pos
        return RopeConfig("llama3", float(theta), float(partial), float(params["factor"]),
                          float(params.get("low_freq_factor", 1.0)),
                          float(params.get("high_freq_factor", 4.0)), int(original))
    if not math.isfinite(float(theta)) or float(theta) <= 0:
        raise ConfigError(f"rope_theta must be positive, got {theta!r}")
    return RopeConfig(rope_type, float(theta), float(partial))
