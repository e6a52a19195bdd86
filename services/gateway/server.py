"""Wiring for the embedded deployment: one process, the exact engine behind the gateway."""
from __future__ import annotations

from pathlib import Path

import torch

from models import load_model
from services.common.tokenizer import default_temperature, eos_token_ids, load_tokenizer
from services.engine import EngineConfig, LLMEngine
from services.gateway.app import Gateway, build_app
from services.gateway.backend import EngineBackend


def build_embedded(model_dir: str | Path, served_name: str | None = None,
                   dtype: torch.dtype = torch.float32, max_num_seqs: int = 16,
                   kv_cache_bytes: int = 1 << 30):
    model_dir = Path(model_dir)
    model = load_model(model_dir, dtype=dtype)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs,
                                           kv_cache_bytes=kv_cache_bytes),
                       eos_token_ids=eos_token_ids(model_dir))
    gateway = Gateway(EngineBackend(engine), load_tokenizer(model_dir),
                      served_name or model_dir.name, engine.max_model_len,
                      default_temperature(model_dir))
    return build_app(gateway)
