"""Random-weight Hugging Face checkpoints for tests and benchmarks.

Builds the HF `transformers` model of a config dict (see `shared/model_configs.json`), draws
every weight from N(0, std²) and every 1-D parameter (norm weights, A_log, dt_bias) at random
so that (1 + w) norms and the decay gates are really exercised, and saves it with
`save_pretrained`. Needs `transformers` (a test dependency), imported lazily.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

_CLASSES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
}


def build_hf_model(config: dict, seed: int = 0, std: float = 0.15):
    import transformers

    cfg_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[config["model_type"]])
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    hf_cfg = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(hf_cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                if name.endswith("A_log"):
                    p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
                elif name.endswith("dt_bias"):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
                elif "norm" in name and "linear_attn.norm" not in name and _zero_centered(config):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
                else:
                    p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.2)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def _zero_centered(config: dict) -> bool:
    return config["model_type"] in ("qwen3_next", "qwen3_5_text")


def save_random_checkpoint(config: dict, out_dir: str | Path, seed: int = 0, std: float = 0.15,
                           max_shard_size: str | None = None):
    """Save a random checkpoint of `config` to `out_dir`; returns the HF model (fp32)."""
    out_dir = Path(out_dir)
    model = build_hf_model(config, seed, std)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return model


def load_configs(kind: str = "tiny") -> dict[str, dict]:
    """The `tiny` (unit tests) or `bench` configs of `models/model_configs.json`."""
    path = Path(__file__).with_name("model_configs.json")
    return json.loads(path.read_text())[kind]
