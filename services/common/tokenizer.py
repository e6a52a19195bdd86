"""Tokenizer and stop-token discovery for a model directory (lazy `transformers` import)."""
from __future__ import annotations

import json
from pathlib import Path


def has_tokenizer(model_dir: str | Path) -> bool:
    return (Path(model_dir) / "tokenizer.json").exists()


def load_tokenizer(model_dir: str | Path):
    if not has_tokenizer(model_dir):
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json; pass token ids instead")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json (an int or a list in either)."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                return tuple(value) if isinstance(value, list) else (int(value),)
    return ()


def default_temperature(model_dir: str | Path) -> float:
    """Sampling temperature a request without one gets, as the checkpoint's
    generation_config.json says (do_sample false -> greedy); 1.0 without one (OpenAI)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return 1.0
    cfg = json.loads(path.read_text())
    if cfg.get("do_sample") is False:
        return 0.0
    return float(cfg.get("temperature", 1.0))
