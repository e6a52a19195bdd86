"""Wiring for the embedded deployment: one process, the exact engine behind the gateway."""
from __future__ import annotations

from pathlib import Path

import torch

from models import load_model
from services.common.tokenizer import default_temperature, eos_token_ids, load_tokenizer
from services.engine import EngineConfig, LLMEngine
from services.gateway.app import Gateway, build_app
from services.gateway.backend import EngineBackend
from services.prefill.metrics import PrefillMetrics
from services.prefill.service import PrefillConfig, PrefillService


def build_embedded(model_dir: str | Path, served_name: str | None = None,
                   dtype: torch.dtype = torch.float32, max_num_seqs: int = 16,
                   kv_cache_bytes: int = 1 << 30, prefill: PrefillConfig | None = None):
    """`prefill` (server flags --prefill-mode, --maps, ...) adds the RidgeFill prefill
    service; requests then choose with `prefill_mode` / `ridgefill`."""
    model_dir = Path(model_dir)
    model = load_model(model_dir, dtype=dtype)
    service = None
    if prefill is not None and (prefill.maps_dir or prefill.mode != "exact"):
        service = PrefillService(model, prefill)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs,
                                           kv_cache_bytes=kv_cache_bytes),
                       eos_token_ids=eos_token_ids(model_dir), prefill_service=service)
    gateway = Gateway(EngineBackend(engine), load_tokenizer(model_dir),
                      served_name or model_dir.name, engine.max_model_len,
                      default_temperature(model_dir), prefill_service=service)
    if service is not None:
        service.metrics = PrefillMetrics(gateway.metrics.registry)
    return build_app(gateway)
