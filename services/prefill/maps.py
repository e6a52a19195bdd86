"""RidgeFill maps: loading and checking what `tools.calibration` wrote.

For a split S and every upper layer l > S the map predicts layer l's input from the split
state: x̂_l = A_l x_S + b_l, or with `context_rows` c > 0 from [x_S[t], x_S[t−1], …,
x_S[t−c]] (`context_features`). The first `sink_rows` rows of a sequence were left out of
calibration, and fills keep them exact.

On disk (MAPS_DIR):
    stats-S{S}.safetensors   fit and held-out sums (float64), for re-solving
    maps-S{S}.safetensors    A.{l} (bf16, or int8 with per-row A_scale.{l}), b.{l} (fp32),
                             optional delta_state.{l} (terminal-state offsets, hybrids)
    unigram.safetensors      calibration token counts and classes (the `protected` selector)
Every file carries metadata: the model fingerprint, split, λ, calibration tokens, max length,
sink rows and context rows.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from models.model import CausalLM


class MapsError(ValueError):
    """Maps that cannot serve this model or split."""


def model_fingerprint(model: CausalLM, *, exact_values: bool = False) -> str:
    """A stable id of the weights: config plus a strided sample of every parameter, the
    sample rounded to bf16 so that one checkpoint loaded in fp32 or bf16 has one id (maps
    calibrated in fp32 serve a bf16 model). `exact_values`: the sample unrounded, the id
    files written before the rounding carry (`model_fingerprints`)."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(model.config), sort_keys=True,
                                  default=str).encode())
    for name, p in sorted(model.named_parameters()):
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // 257)
        h.update(name.encode() + str(tuple(p.shape)).encode())
        sample = flat[::step] if exact_values else flat[::step].to(torch.bfloat16)
        h.update(sample.float().cpu().numpy().tobytes())
    return h.hexdigest()[:24]


def model_fingerprints(model: CausalLM) -> set[str]:
    """Every id a file made for this model may carry."""
    return {model_fingerprint(model), model_fingerprint(model, exact_values=True)}


def context_features(x: torch.Tensor, rows: torch.Tensor, context_rows: int) -> torch.Tensor:
    """The map's input for `rows` of x [N, d] (split-layer states): x[t] alone, or with
    `context_rows` > 0 also x[t−1], …, x[t−c] side by side ([R, d·(1+c)]; zeros before row
    0). Layers above the split mix the previous token into each row (previous-token heads,
    the key side of induction), which x[t] alone cannot predict."""
    if context_rows == 0:
        return x[rows]
    parts = [x[rows]]
    for j in range(1, context_rows + 1):
        prev = rows - j
        parts.append(x[prev.clamp_min(0)] * (prev >= 0)[:, None].to(x.dtype))
    return torch.cat(parts, dim=-1)


def upper_layers(num_layers: int, split: int) -> tuple[int, ...]:
    return tuple(range(split + 1, num_layers))


def check_split(num_layers: int, split: int) -> None:
    if not isinstance(split, int) or not 1 <= split <= num_layers - 1:
        raise MapsError(f"split must be an integer in 1..{num_layers - 1} "
                        f"(the model has {num_layers} layers), got {split!r}")


# ---- loading ----------------------------------------------------------------------------
def _layout(meta: dict) -> tuple[int, int]:
    """(sink rows, context rows) from maps metadata; maps from before either setting: 0."""
    return int(meta.get("sink_rows", 0)), int(meta.get("context_rows", 0))


class RidgeMaps:
    """The maps of one split, checked against the model; resident, or streamed per layer.

    `get(l)` -> (A [d, d·(1+c)], b [d]) on the model's device, in `dtype` (default: the
    model's; a fill in bf16 keeps them as stored). Streamed maps read layer l from the file
    when asked and keep nothing.
    """

    def __init__(self, maps_dir: str | Path, model: CausalLM, split: int, *,
                 resident: bool = True, dtype: torch.dtype | None = None):
        self.path = Path(maps_dir) / f"maps-S{split}.safetensors"
        if not self.path.exists():
            raise MapsError(f"no maps for split {split} in {maps_dir} "
                            f"(calibrate with --splits {split})")
        with safe_open(str(self.path), "pt") as f:
            self.meta = f.metadata()
            self._keys = set(f.keys())
        fp = model_fingerprint(model)
        if self.meta.get("fingerprint") not in model_fingerprints(model):
            raise MapsError(f"maps in {self.path} were calibrated for model "
                            f"{self.meta.get('fingerprint')}, not this one ({fp})")
        if int(self.meta["split"]) != split:
            raise MapsError(f"{self.path} holds split {self.meta['split']}, not {split}")
        self.split, self.model = split, model
        self.device, self.dtype = model.device, dtype or model.dtype
        self.layers = upper_layers(model.config.num_hidden_layers, split)
        self.map_id = f"{fp}/S{split}/λ{self.meta['lambda']}"
        if self.dtype != model.dtype:          # a fill in another precision is another fill
            self.map_id += f"/{str(self.dtype).removeprefix('torch.')}"
        # rows left out of calibration (fills keep them exact, as the maps never saw them)
        # and previous rows the map reads
        self.sink_rows, self.context_rows = _layout(self.meta)
        self.resident = resident
        self._cache = {l: self._read(l) for l in self.layers} if resident else {}

    @staticmethod
    def layout_of(maps_dir: str | Path, split: int) -> tuple[int, int]:
        """(sink rows, context rows) of a split's maps, read from the file's metadata
        without loading or checking them; (0, 0) when there are no maps."""
        path = Path(maps_dir) / f"maps-S{split}.safetensors"
        if not path.exists():
            return 0, 0
        with safe_open(str(path), "pt") as f:
            return _layout(f.metadata())

    def _read(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        with safe_open(str(self.path), "pt") as f:
            a = f.get_tensor(f"A.{l}")
            if a.dtype == torch.int8:
                a = a.float() * f.get_tensor(f"A_scale.{l}")[:, None]
            b = f.get_tensor(f"b.{l}")
        return a.to(self.device, self.dtype), b.to(self.device, self.dtype)

    def get(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache[l] if self.resident else self._read(l)

    def delta_state(self, l: int) -> torch.Tensor | None:
        key = f"delta_state.{l}"
        if key not in self._keys:
            return None
        with safe_open(str(self.path), "pt") as f:
            return f.get_tensor(key).to(self.device)

    @property
    def resident_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self._cache.values())

    @property
    def file_bytes(self) -> int:
        return self.path.stat().st_size


def load_unigram(maps_dir: str | Path, model: CausalLM):
    """-> (token counts [V] float64, token classes [V] int8 or None)."""
    path = Path(maps_dir) / "unigram.safetensors"
    with safe_open(str(path), "pt") as f:
        if f.metadata().get("fingerprint") not in model_fingerprints(model):
            raise MapsError(f"{path} was counted for another model")
        cls = f.get_tensor("token_class") if "token_class" in f.keys() else None
        return f.get_tensor("counts"), cls


WORD_START = ("Ġ", "▁", " ")
