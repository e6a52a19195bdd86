"""Load a Hugging Face directory (config.json + single or sharded safetensors)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from models.config import ModelConfig
from models.model import CausalLM


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not fit its config; names the offending tensors."""


_SKIP = re.compile(r"^(model\.visual\.|visual\.|mtp\.|model\.mtp\.)")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            return sorted({path / name for name in json.load(f)["weight_map"].values()})
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors weights in {path}")
    return files


def normalize_name(name: str) -> str | None:
    """Map a checkpoint tensor name onto ours; None for tensors we skip (vision, MTP)."""
    if _SKIP.match(name):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def read_state_dict(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for raw in f.keys():
                name = normalize_name(raw)
                if name is None:
                    continue
                tensor = f.get_tensor(raw).to(dtype)
                m = _EXPERT.match(name)
                if m:
                    experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = tensor
                    continue
                name = name.replace(".mlp.experts.gate_up_proj", ".mlp.experts_gate_up")
                name = name.replace(".mlp.experts.down_proj", ".mlp.experts_down")
                state[name] = tensor
    for prefix, per_expert in experts.items():
        ids = sorted(per_expert)
        state[f"{prefix}.experts_gate_up"] = torch.stack(
            [torch.cat([per_expert[e]["gate"], per_expert[e]["up"]]) for e in ids])
        state[f"{prefix}.experts_down"] = torch.stack([per_expert[e]["down"] for e in ids])
    return state


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> CausalLM:
    """Build the model of `path`'s config and load its weights (strict: no missing tensors)."""
    path = Path(path)
    cfg = ModelConfig.from_pretrained(path)
    state = read_state_dict(path, dtype)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing tensors {sorted(missing)[:8]}, "
                              f"unexpected tensors {sorted(unexpected)[:8]}")
    model.load_state_dict(state, assign=True, strict=True)
    model.rotary.inv_freq = model.rotary.inv_freq.to(device)
    return model.to(device).eval().requires_grad_(False).fuse_projections()
