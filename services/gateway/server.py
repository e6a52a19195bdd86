"""Wiring for the embedded deployment: one process, the exact engine behind the gateway."""
from __future__ import annotations

from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from models import load_model
from services.common.tokenizer import default_temperature, eos_token_ids, load_tokenizer
from services.engine import EngineConfig, LLMEngine
from services.gateway.app import Gateway, build_app
from services.gateway.backend import EngineBackend
from services.gateway.metrics import GatewayMetrics
from services.prefill.maps import model_fingerprint
from services.prefill.metrics import PrefillMetrics
from services.prefill.service import PrefillConfig, PrefillService
from services.prefix_cache import PrefixCache, PrefixCacheConfig, PrefixCacheMetrics
from services.prefix_cache.replay import TailReplayConfig


def build_embedded(model_dir: str | Path, served_name: str | None = None,
                   dtype: torch.dtype = torch.float32, max_num_seqs: int = 16,
                   kv_cache_bytes: int = 1 << 30, prefill: PrefillConfig | None = None,
                   prefix_cache_bytes: int | None = None, prefix_block_size: int = 16,
                   redis_url: str | None = None, reuse_filled: bool = False,
                   replay_ratio: float = 0.1):
    """`prefill` (server flags --prefill-mode, --maps, ...) adds the RidgeFill prefill
    service; requests then choose with `prefill_mode` / `ridgefill`. `prefix_cache_bytes`
    (--prefix-cache) turns the prefix cache on, keyed by the model's fingerprint and dtype;
    requests may set their own `replay_ratio`."""
    model_dir = Path(model_dir)
    TailReplayConfig(replay_ratio)      # refuse a bad flag before loading anything
    model = load_model(model_dir, dtype=dtype)
    service = None
    if prefill is not None and (prefill.maps_dir or prefill.mode != "exact"):
        service = PrefillService(model, prefill)
    registry = CollectorRegistry()
    cache = None
    if prefix_cache_bytes is not None:
        config = PrefixCacheConfig(namespace=f"{model_fingerprint(model)}:{dtype}",
                                   block_size=prefix_block_size,
                                   capacity_bytes=prefix_cache_bytes, reuse_filled=reuse_filled,
                                   redis_url=redis_url)
        cache = PrefixCache(config, PrefixCacheMetrics(registry))
    engine = LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs,
                                           kv_cache_bytes=kv_cache_bytes),
                       eos_token_ids=eos_token_ids(model_dir), prefill_service=service,
                       prefix_cache=cache, replay_ratio=replay_ratio)
    gateway = Gateway(EngineBackend(engine), load_tokenizer(model_dir),
                      served_name or model_dir.name, engine.max_model_len,
                      default_temperature(model_dir), prefill_service=service,
                      metrics=GatewayMetrics(registry))
    if service is not None:
        service.metrics = PrefillMetrics(gateway.metrics.registry)
    return build_app(gateway)


def build_cluster(config, address: str | None = None, served_name: str | None = None,
                  num_cpus: int | None = None):
    """The disaggregated deployment: start (or join) Ray, place the pool replicas and the
    attention services (`services.common.ray_deploy`), and put the gateway in front of the
    attention services. Returns (app, cluster)."""
    from services.common.ray_deploy import deploy, init_ray
    from services.gateway.cluster_backend import ClusterBackend

    model_dir = Path(config.model)
    init_ray(address, num_cpus=num_cpus)
    cluster = deploy(config)
    metrics = GatewayMetrics()
    gateway = Gateway(ClusterBackend(cluster.attention_addresses, metrics.registry),
                      load_tokenizer(model_dir), served_name or model_dir.name,
                      cluster.max_model_len, default_temperature(model_dir), metrics=metrics)
    return build_app(gateway), cluster
