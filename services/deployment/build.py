"""One engine as the server flags describe it: the exact engine, plus the RidgeFill prefill
service and the prefix cache when configured. The embedded deployment and each prefill
replica of the disaggregated one build theirs here (and an attention service holding the
whole model its RidgeFill service), so all read the flags the same way."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from models.model import CausalLM
from services.common.tokenizer import eos_token_ids, has_tokenizer, load_tokenizer
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.metrics import EngineCollector
from services.engine.speculative import NgramConfig
from services.engine.structured import Grammars, StructuredMetrics
from services.prefill.lexicon import Lexicon
from services.prefill.maps import model_fingerprint
from services.prefill.metrics import PrefillMetrics
from services.prefill.service import PrefillConfig, PrefillService
from services.prefix_cache import PrefixCache, PrefixCacheConfig, PrefixCacheMetrics
from services.prefix_cache.replay import TailReplayConfig


@dataclass(frozen=True)
class EngineOptions:
    max_num_seqs: int = 16
    kv_cache_bytes: int = 1 << 30
    prefill: PrefillConfig | None = None      # --prefill-mode, --maps, ...: RidgeFill service
    prefix_cache_bytes: int | None = None     # --prefix-cache: memory tier capacity
    prefix_block_size: int = 16
    redis_url: str | None = None
    redis_ttl_s: int | None = None            # --prefix-cache-ttl: Redis entries expire
    reuse_filled: bool = False
    replay_ratio: float = 0.1
    compile_decode: bool = False              # --compile: decode steps as compiled graphs
    quantization: str | None = None           # --quantization int8 (applied where loaded)
    speculative: NgramConfig | None = None    # --speculative-config: n-gram drafts
    structured_backend: str = "auto"          # --structured-outputs-backend
    prefill_threads: int | None = None        # torch threads of a prefilling step

    def __post_init__(self):
        TailReplayConfig(self.replay_ratio)   # refuse a bad flag before loading anything
        if self.quantization not in (None, "int8"):
            raise ValueError(f"unknown quantization {self.quantization!r}")

    @property
    def ridgefill(self) -> bool:
        p = self.prefill
        return p is not None and (p.maps_dir is not None or p.mode != "exact")


def build_prefill_service(model: CausalLM, model_dir: str | Path, options: EngineOptions,
                          registry) -> PrefillService | None:
    """The RidgeFill prefill service the flags ask for (None: none); its metrics go into
    `registry`."""
    if not options.ridgefill:
        return None
    lexicon = (Lexicon.from_tokenizer(load_tokenizer(model_dir), model.config.vocab_size)
               if has_tokenizer(model_dir) else None)
    return PrefillService(model, options.prefill, PrefillMetrics(registry), lexicon)


def grammars_for(model_dir: str | Path, vocab_size: int, registry=None,
                 backend: str = "auto") -> Grammars | None:
    """Structured outputs for an engine of this checkpoint on `backend`: None without its
    tokenizer. The backend and the tokenizer load on the first structured request; the
    metrics go into `registry` when given."""
    if not has_tokenizer(model_dir):
        return None
    return Grammars(functools.partial(load_tokenizer, model_dir), vocab_size,
                    eos_token_ids(model_dir),
                    StructuredMetrics(registry) if registry is not None else None,
                    backend=backend)


def build_engine(model: CausalLM, model_dir: str | Path, options: EngineOptions,
                 registry, structured: bool = True) -> tuple[LLMEngine, PrefillService | None]:
    """-> (engine, its RidgeFill prefill service or None). The engine's, the prefill and
    the prefix-cache metrics go into `registry`; `model` is already quantized as
    `options.quantization` says (`load_model(...).quantize(...)`, where it is loaded); the prefix cache is keyed by the
    model's fingerprint and dtype, so replicas of one checkpoint share Redis entries and
    other checkpoints never see them. `structured`: the engine takes structured-output
    requests (its grammars compile with the model's tokenizer, loaded on first use); a
    prefill replica, which never samples past the first token, builds none."""
    service = build_prefill_service(model, model_dir, options, registry)
    cache = None
    if options.prefix_cache_bytes is not None:
        config = PrefixCacheConfig(namespace=f"{model_fingerprint(model)}:{model.dtype}",
                                   block_size=options.prefix_block_size,
                                   capacity_bytes=options.prefix_cache_bytes,
                                   reuse_filled=options.reuse_filled,
                                   redis_url=options.redis_url,
                                   redis_ttl_s=options.redis_ttl_s)
        cache = PrefixCache(config, PrefixCacheMetrics(registry))
    grammars = (grammars_for(model_dir, model.config.vocab_size, registry,
                             options.structured_backend) if structured else None)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=options.max_num_seqs,
                                           kv_cache_bytes=options.kv_cache_bytes,
                                           compile_decode=options.compile_decode,
                                           compile_in_background=True,
                                           speculative=options.speculative,
                                           prefill_threads=options.prefill_threads),
                       eos_token_ids=eos_token_ids(model_dir), prefill_service=service,
                       prefix_cache=cache, replay_ratio=options.replay_ratio,
                       grammars=grammars)
    registry.register(EngineCollector(engine))
    return engine, service

