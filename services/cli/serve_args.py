"""`ServeArgs`: every `splitstack serve` flag in one frozen dataclass (vLLM's `EngineArgs`,
SGLang's `ServerArgs`), and the configs the serving code takes, built from it.

One field is one flag: `--name-with-dashes` for `name_with_dashes`, with its default, help,
choices and range in the field's metadata. `add_cli_args` turns those into argparse
arguments (a value out of range is a usage error), and `__post_init__` applies the same
checks to a `ServeArgs` built in code, raising `FlagError` that names the flag.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
import types
import typing
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

from services.cli.argtypes import DTYPES, bounded, describe_range, in_range, resolve_dtype

if TYPE_CHECKING:
    from services.common.grpc_security import GrpcSecurity
    from services.deployment.autoscale import Autoscaler
    from services.deployment.build import EngineOptions
    from services.deployment.ray_cluster import ClusterConfig
    from services.engine.speculative import NgramConfig
    from services.gateway.limits import HttpLimits
    from services.gateway.ratelimit import RateLimits
    from services.prefill.service import PrefillConfig

# argument groups of `splitstack serve --help`, by the key in a field's metadata
GROUPS = {
    "qfirst": "disaggregated Q-First decode on Ray (any of these flags turns it on; without "
              "them one embedded engine serves)",
    "ridgefill": "RidgeFill prefill (requests may override: prefill_mode, ridgefill={...})",
    "prefix": "prefix cache (Tail-Replay; requests may override: replay_ratio)",
    "limits": "HTTP limits and backpressure (refused requests get an OpenAI-style error)",
    "scaling": "elastic pools (the Ray deployment: PUT /admin/pools/{pool}, splitstack scale) "
               "and draining on SIGTERM",
    "grpc": "the internal gRPC channels of the Ray deployment: a shared token on every call "
            "(from --grpc-token-file, $SPLITSTACK_GRPC_TOKEN_FILE or $SPLITSTACK_GRPC_TOKEN; "
            "none given: a random one per deployment) and optional TLS",
}


def flag(default, help: str, *, choices=None, low=None, high=None, group=None,
         env: str | None = None):
    """A field that is a serve flag. `env`: an environment variable that supplies the
    default when set (read when the dataclass or the parser is built)."""
    meta = {"help": help, "choices": choices, "low": low, "high": high, "group": group}
    if env is None:
        return field(default=default, metadata=meta)
    return field(default_factory=lambda: os.environ.get(env) or default, metadata=meta)


def usable_cores() -> int:
    """Cores this process may run on (its affinity, as a container's cpuset sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class FlagError(ValueError):
    """A serve flag's value, or a combination of flags, that serving refuses."""

    def __init__(self, flag: str, value, message: str):
        super().__init__(message)
        self.flag, self.value = flag, value


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class ServeArgs:
    model: str = flag("models/zoo/smollm2-135m", "Hugging Face model directory")
    served_model_name: str | None = flag(
        None, "name clients use (default: the directory name)")
    host: str = flag("127.0.0.1", "address the HTTP server (and, on Ray, each actor's gRPC "
                                  "server) binds; 0.0.0.0: all")
    port: int = flag(8000, "HTTP port", low=1, high=65535)
    api_key: str | None = flag(None, "clients of /v1/ must send 'Authorization: Bearer KEY' "
                                     "(default: $SPLITSTACK_API_KEY; unset: no key)",
                               env="SPLITSTACK_API_KEY")
    admin_api_key: str | None = flag(None, "callers of /admin/ (pool sizes) must send "
                                           "'Authorization: Bearer KEY'; the --api-key does "
                                           "not open them (default: "
                                           "$SPLITSTACK_ADMIN_API_KEY; unset: the --api-key)",
                                     env="SPLITSTACK_ADMIN_API_KEY")
    dtype: str = flag("auto", "weights, activations and KV cache of the model; auto: "
                              "bfloat16 on a CPU with native bf16 (AVX512-BF16, AMX), else "
                              "float32 (also with --gpu)", choices=("auto", *sorted(DTYPES)))
    quantization: str | None = flag(None, "int8: int8 weights (per-row scales) for the "
                                          "decode steps' products, with int8 activations "
                                          "(per 32 columns) on AVX512-VNNI; prompts keep "
                                          "the weights (1.5x the weight memory)",
                                    choices=("int8",))
    compile: bool = flag(False, "decode steps as torch.compile'd graphs, one per batch "
                                "bucket, built beside the engine at start: steps run "
                                "eagerly until theirs is ready (CPU, dense full-attention "
                                "models; cached under ~/.cache/splitstack/torchinductor)")
    speculative_config: str | None = flag(None, "speculative decoding without a draft "
                                                "model, as JSON (vLLM's form): {\"method\": "
                                                "\"ngram\", \"num_speculative_tokens\": 4, "
                                                "\"prompt_lookup_max\": 4, "
                                                "\"prompt_lookup_min\": 2}; greedy requests "
                                                "of the embedded engine draft")
    max_num_seqs: int = flag(16, "sequences an engine runs at once (on Ray: per attention "
                                 "service)", low=1)
    kv_cache_gib: float = flag(1.0, "memory for the paged KV cache; caps the context length",
                               low=1e-3)
    threads: int | None = flag(None, "torch threads (embedded: one fewer than this "
                                     "process's cores, at least 1, so the HTTP front end "
                                     "keeps a core; per Ray actor: 1)", low=1)
    chat_template: str | None = flag(None, "a jinja chat template file, instead of the "
                                           "model's (default: the model's, or for tools the "
                                           "shipped Hermes template when it has none)")
    tool_call_parser: str | None = flag(None, "the format tool calls are written and parsed in "
                                              "(default: the one the chat template implies)",
                                        choices=("hermes", "llama3_json"))
    structured_outputs_backend: str = flag("auto", "the grammar backend of structured "
                                                   "outputs and forced tool calls (vLLM's "
                                                   "structured_outputs_config.backend): auto "
                                                   "tries xgrammar, then llguidance for a spec "
                                                   "xgrammar cannot compile",
                                           choices=("auto", "xgrammar", "guidance"))
    reasoning_parser: str | None = flag(None, "split a thinking model's <think> block into "
                                              "reasoning_content", choices=("qwen3",
                                                                            "deepseek_r1"))
    responses_redis_url: str | None = flag(None, "keep /v1/responses' stored responses in this "
                                                 "Redis (default: in the gateway's memory)")
    responses_ttl: int = flag(3600, "seconds a stored response stays retrievable and "
                                    "continuable (previous_response_id)", low=1)
    engine_process: bool = flag(False, "embedded: run the engine in its own process, so the "
                                       "HTTP front end never holds a step back")
    log_level: str = flag("info", "uvicorn's log level")
    otlp_traces_endpoint: str | None = flag(
        None, "export request traces (OpenTelemetry spans of the gateway, and on Ray of the "
              "attention services and prefill replicas) over OTLP/gRPC to this collector, "
              "e.g. http://otel-collector:4317 (default: "
              "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; unset: no tracing)",
        env="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")

    disaggregated: bool = flag(False, "attention services + MLP pool as Ray actors (defaults "
                                      "below)", group="qfirst")
    address: str | None = flag(None, "join this Ray cluster instead of starting a local one",
                               group="qfirst")
    attention_shards: int | None = flag(
        None, "attention services; each owns its requests and their KV (1)", low=1,
        group="qfirst")
    kv_splits: int = flag(1, "KV shards one sequence's cache is split over, per attention "
                             "service", low=1, group="qfirst")
    mlp_replicas: int | None = flag(None, "MLP pool replicas (1)", low=1, group="qfirst")
    wiring: str | None = flag(None, "default: what the checkpoint was trained for (it refuses "
                                    "others)", choices=("standard", "qfirst"), group="qfirst")
    transport: str | None = flag(None, "attention <-> pool data plane (grpc; nccl needs --gpu)",
                                 choices=("local", "grpc", "nccl"), group="qfirst")
    gpu: bool = flag(False, "one CUDA device per actor", group="qfirst")
    prefill_replicas: int | None = flag(
        None, "prefill service replicas; every prompt is prefilled there, with RidgeFill and "
              "the prefix cache as configured below (default: 1 with --maps / --prefill-mode "
              "ridgefill / --prefix-cache, else 0: the attention service prefills through the "
              "pool)", low=0, group="qfirst")

    prefill_mode: str = flag("exact", "the prefill requests get unless they choose",
                             choices=("exact", "ridgefill"), group="ridgefill")
    maps: str | None = flag(None, "maps directory from `splitstack calibrate`",
                            group="ridgefill")
    maps_streamed: bool = flag(False, "read maps one layer at a time instead of keeping them "
                                      "resident", group="ridgefill")
    fill_dtype: str = flag("model", "precision of the filled rows' map, norm and K/V (or Gated "
                                    "DeltaNet input) projections; exact rows keep the model's "
                                    "dtype. bfloat16 speeds the fill on CPUs with bf16 "
                                    "products", choices=("model", "bfloat16"),
                           group="ridgefill")
    split: int | None = flag(None, "split S (default: half depth)", low=1, group="ridgefill")
    tail: int = flag(256, "exact tail T", low=0, group="ridgefill")
    selector: str = flag("none", "rows of the prefix computed exactly, and how they are picked",
                         choices=("none", "attention", "question-blind", "protected", "probe",
                                  "random"), group="ridgefill")
    budget: float = flag(0.1, "selector's share of prefix rows", low=0.0, high=1.0,
                         group="ridgefill")
    value_rescale: int = flag(0, "c tail rows (0: off)", low=0, group="ridgefill")
    key_rescale: int = flag(0, "c tail rows measuring a key magnitude scale (0: off)", low=0,
                            group="ridgefill")
    terminal_correction: bool = flag(False, "hybrids: add the maps' calibrated terminal-state "
                                            "offsets ΔM to the Gated DeltaNet states of filled "
                                            "rows", group="ridgefill")
    lexical: float = flag(0.05, "probe selector: share of prefix rows reserved within the "
                                "budget for the lexical net's sentences (0: attention "
                                "ranking alone)", low=0.0, high=1.0, group="ridgefill")
    lexical_rank: str = flag("bm25", "the lexical net's order of sentences: bm25 (Okapi BM25, "
                                     "the question at the prompt's end weighted most) or shared "
                                     "(the seed's: most shared rare words)",
                             choices=("bm25", "shared"), group="ridgefill")

    prefix_cache: bool = flag(False, "reuse cached prompt prefixes at token granularity",
                              group="prefix")
    prefix_cache_bytes: int = flag(1 << 30, "capacity of the in-process memory tier", low=0,
                                   group="prefix")
    prefix_block_size: int = flag(16, "tokens per hashed block of the index", low=1,
                                  group="prefix")
    redis_url: str | None = flag(None, "shared Redis tier and index, e.g. "
                                       "redis://127.0.0.1:6379/0", group="prefix")
    prefix_cache_ttl: int | None = flag(None, "seconds a prefix-cache entry stays in Redis "
                                              "(default: until Redis evicts it)", low=1,
                                        group="prefix")
    reuse_filled: bool = flag(False, "also reuse rows a RidgeFill prefill filled",
                              group="prefix")
    replay_ratio: float = flag(0.1, "r: replay the last ceil(r·m) rows of an m-token hit "
                                    "through the linear-attention layers (hybrid models; 0: "
                                    "zero-only)", low=0.0, high=1.0, group="prefix")

    max_body_bytes: int = flag(4 << 20, "larger request bodies get 413 (refused by their "
                                        "Content-Length before they are read)", low=1,
                               group="limits")
    body_timeout: float = flag(30.0, "seconds to receive a request body once its headers "
                                     "came; then 408", low=1e-3, group="limits")
    header_timeout: float = flag(10.0, "seconds from a connection (or a kept-alive request's "
                                       "first byte) to the end of the request headers; then "
                                       "the connection is closed", low=1e-3, group="limits")
    keep_alive_timeout: int = flag(5, "seconds an idle kept-alive connection stays open",
                                   low=1, group="limits")
    max_connections_per_client: int = flag(64, "open connections one client address may hold; "
                                               "past it 429 (behind a proxy every client is "
                                               "the proxy's address: raise it)", low=1,
                                           group="limits")
    max_waiting_requests: int = flag(64, "generation requests waiting beyond those the "
                                         "engines run at once; past it 503 with Retry-After",
                                     low=0, group="limits")
    rate_limit_rpm: int | None = flag(None, "requests per minute per API key (or client "
                                            "address), shared through Redis; past it 429",
                                      low=1, group="limits")
    rate_limit_tpm: int | None = flag(None, "tokens per minute per API key: prompt plus "
                                            "max_tokens per completion", low=1,
                                      group="limits")
    rate_limit_redis: str = flag("redis://127.0.0.1:6379/0", "Redis holding the rate-limit "
                                 "buckets (unreachable: requests are served, and counted)",
                                 group="limits")

    grpc_token_file: str | None = flag(None, "file holding the token (a mounted Secret)",
                                       group="grpc")
    grpc_tls_cert: str | None = flag(None, "PEM certificate the gRPC servers present",
                                     group="grpc")
    grpc_tls_key: str | None = flag(None, "PEM private key of --grpc-tls-cert", group="grpc")
    grpc_tls_ca: str | None = flag(None, "PEM CA that clients verify the servers with",
                                   group="grpc")

    max_replicas: int = flag(8, "most members one pool may have; larger counts are refused "
                                "(400)", low=1, group="scaling")
    drain_timeout: float = flag(30.0, "seconds a drain may take: after SIGTERM (readiness "
                                      "503, new generation requests 503) the server exits "
                                      "once no request is in flight or this passes; a pool "
                                      "member leaving is killed after it", low=0.0,
                                group="scaling")
    autoscale: str | None = flag(None, "autoscale these pools between MIN and MAX members, "
                                       "e.g. attention=1:4,mlp=1:4,prefill=1:2 (signals: KV "
                                       "usage and waiting requests; MLP stage latency and "
                                       "busy share; prefill queue and TTFT)", group="scaling")
    autoscale_interval: float = flag(10.0, "seconds between the autoscaler's decisions (at "
                                           "most one change per pool each)", low=0.1,
                                     group="scaling")
    autoscale_cooldown: float = flag(30.0, "seconds a pool waits after a change before the "
                                           "autoscaler changes it again", low=0.0,
                                     group="scaling")
    slo_ttft_ms: float | None = flag(None, "TTFT objective: 95%% of first tokens within it "
                                           "(default 2000); exported for the alert rules and "
                                           "dashboards, and with --autoscale the p95 over "
                                           "which a prefill replica is added", low=1.0,
                                     group="scaling")
    slo_itl_ms: float | None = flag(None, "inter-token latency objective: 95%% of token gaps "
                                          "within it (default 200); exported as --slo-ttft-ms "
                                          "is, and with --autoscale the p95 over which an "
                                          "attention service or MLP replica is added",
                                    low=1.0, group="scaling")

    def __post_init__(self):
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise FlagError("--chat-template", self.chat_template, "--chat-template: no such "
                            f"file: {self.chat_template}")
        for f in fields(self):
            _check(f, getattr(self, f.name))
        if not self.prefix_cache and (self.redis_url or self.reuse_filled
                                      or self.prefix_cache_ttl):
            raise FlagError("--prefix-cache", False, "--redis-url, --prefix-cache-ttl and "
                            "--reuse-filled need --prefix-cache")
        # what the configs refuse in combination (--transport nccl without --gpu, RidgeFill
        # or the prefix cache with --prefill-replicas 0) is refused here too, before loading
        self.engine_options()
        self.http_limits()
        self.rate_limits()
        if self.uses_cluster:
            self.cluster_config()
        self.autoscaler()

    def autoscaler(self) -> Autoscaler | None:
        """The `--autoscale` autoscaler, or None; a malformed value raises FlagError."""
        from services.deployment.autoscale import (AutoscaleError, Autoscaler, Policy,
                                                   parse_autoscale)

        if self.autoscale is None:
            return None
        if not self.uses_cluster:
            raise FlagError("--autoscale", self.autoscale, "--autoscale resizes the Ray "
                            "deployment's pools: give a Q-First flag too (e.g. "
                            "--disaggregated)")
        try:
            bounds = parse_autoscale(self.autoscale)
        except AutoscaleError as err:
            raise FlagError("--autoscale", self.autoscale, f"--autoscale {err}") from None
        for pool, (_, high) in bounds.items():
            if high > self.max_replicas:
                raise FlagError("--autoscale", self.autoscale,
                                f"--autoscale {pool}'s MAX {high} is over --max-replicas "
                                f"{self.max_replicas}")
        ms = (lambda v: None if v is None else v / 1e3)
        return Autoscaler(bounds, Policy(interval_s=self.autoscale_interval,
                                         cooldown_s=self.autoscale_cooldown,
                                         slo_ttft_s=ms(self.slo_ttft_ms),
                                         slo_itl_s=ms(self.slo_itl_ms)))

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        groups = {None: parser}
        for f in fields(cls):
            meta, (kind, _) = f.metadata, _KINDS[f.name]
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_argument_group(GROUPS[meta["group"]])
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if kind is bool:      # a flag on by default is turned off with --no-...
                groups[meta["group"]].add_argument(
                    flag_name(f.name), default=default, help=meta["help"],
                    action=argparse.BooleanOptionalAction if default else "store_true")
                continue
            low, high = meta["low"], meta["high"]
            groups[meta["group"]].add_argument(
                flag_name(f.name), default=default, choices=meta["choices"], help=meta["help"],
                type=bounded(low, kind, high) if low is not None or high is not None else kind)
        return parser

    @classmethod
    def from_cli(cls, namespace: argparse.Namespace) -> ServeArgs:
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls)})

    @property
    def uses_cluster(self) -> bool:
        """Any Q-First flag asks for the Ray deployment; without them one embedded engine
        serves."""
        return bool(self.disaggregated or self.address or self.attention_shards
                    or self.mlp_replicas or self.transport or self.wiring
                    or self.prefill_replicas is not None)

    @property
    def dtype_name(self) -> str:
        """--dtype with `auto` resolved for this machine."""
        return resolve_dtype(self.dtype, self.gpu)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def torch_threads(self) -> int:
        """The embedded engine leaves one core to the front end: a step's OpenMP threads
        wait on each other many times a step, so one preempted by the gateway, the
        detokenizer or a local client stalls them all (on 2 cores, 2 threads served
        0.63-0.90x the tokens/s of 1, docs/results/peers.md)."""
        return self.threads or (1 if self.uses_cluster else max(1, usable_cores() - 1))

    @property
    def prefill_threads(self) -> int | None:
        """A step that prefills takes every core (the embedded engine, --threads not
        given): its products are large, the front end waits meanwhile, and a short prompt's
        first token came 1.4x sooner on 2 threads than on 1."""
        if self.threads is not None or self.uses_cluster or usable_cores() <= self.torch_threads:
            return None
        return usable_cores()

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.kv_cache_gib * (1 << 30))

    def prefill_config(self) -> PrefillConfig:
        """The RidgeFill settings; with --prefill-mode exact and no --maps the engine builds
        no prefill service and this goes unused."""
        from services.prefill.service import PrefillConfig

        return PrefillConfig(mode=self.prefill_mode, maps_dir=self.maps,
                             resident=not self.maps_streamed, split=self.split, tail=self.tail,
                             selector=self.selector, budget=self.budget,
                             value_rescale=self.value_rescale, key_rescale=self.key_rescale,
                             terminal_correction=self.terminal_correction,
                             lexical=self.lexical, lexical_rank=self.lexical_rank,
                             fill_dtype=self.fill_dtype)

    def engine_options(self) -> EngineOptions:
        """An engine's settings: the embedded one's, or each prefill replica's on Ray."""
        from services.deployment.build import EngineOptions

        return EngineOptions(max_num_seqs=self.max_num_seqs, kv_cache_bytes=self.kv_cache_bytes,
                             prefill=self.prefill_config(),
                             prefix_cache_bytes=self.prefix_cache_bytes if self.prefix_cache
                             else None,
                             prefix_block_size=self.prefix_block_size, redis_url=self.redis_url,
                             redis_ttl_s=self.prefix_cache_ttl,
                             reuse_filled=self.reuse_filled, replay_ratio=self.replay_ratio,
                             compile_decode=self.compile, quantization=self.quantization,
                             speculative=self.speculative(),
                             structured_backend=self.structured_outputs_backend,
                             prefill_threads=self.prefill_threads)

    def speculative(self) -> NgramConfig | None:
        """--speculative-config as the engine takes it; a malformed value raises
        FlagError."""
        import json

        from services.engine.speculative import NgramConfig

        if self.speculative_config is None:
            return None
        try:
            spec = json.loads(self.speculative_config)
            if not isinstance(spec, dict):
                raise ValueError("it must be a JSON object")
            return NgramConfig.from_dict(spec)
        except (ValueError, TypeError) as err:
            raise FlagError("--speculative-config", self.speculative_config,
                            f"--speculative-config: {err}") from None

    def gateway_options(self) -> dict:
        """What the gateway reads of the flags: the chat template, the tool-call and
        reasoning formats, where /v1/responses keeps responses, the objectives it exports
        and the admin key."""
        from services.gateway.metrics import objectives_for
        from services.gateway.responses import ResponseStore

        ms = (lambda v: None if v is None else v / 1e3)
        return {"objectives": objectives_for(ms(self.slo_ttft_ms), ms(self.slo_itl_ms)),
                "admin_key": self.admin_api_key,
                "chat_template": Path(self.chat_template).read_text()
                if self.chat_template else None, "tool_call_parser": self.tool_call_parser,
                "reasoning_parser": self.reasoning_parser,
                "responses": ResponseStore(self.responses_redis_url, self.responses_ttl)}

    def http_limits(self) -> HttpLimits:
        from services.gateway.limits import HttpLimits

        return HttpLimits(max_body_bytes=self.max_body_bytes, body_timeout_s=self.body_timeout,
                          header_timeout_s=self.header_timeout,
                          keep_alive_s=self.keep_alive_timeout,
                          max_connections_per_client=self.max_connections_per_client,
                          max_waiting_requests=self.max_waiting_requests)

    def rate_limits(self) -> RateLimits:
        from services.gateway.ratelimit import RateLimits

        return RateLimits(self.rate_limit_rpm, self.rate_limit_tpm, self.rate_limit_redis)

    def grpc_security(self) -> GrpcSecurity:
        """Read when the Ray deployment is configured; a missing file raises OSError."""
        from services.common.grpc_security import GrpcSecurity

        return GrpcSecurity.load(self.grpc_token_file, self.grpc_tls_cert, self.grpc_tls_key,
                                 self.grpc_tls_ca, generate=True)

    def cluster_config(self) -> ClusterConfig:
        """The Ray deployment: unset Q-First sizes are 1, the transport gRPC, and the prefill
        service gets one replica when RidgeFill or the prefix cache needs it."""
        from services.deployment.ray_cluster import ClusterConfig

        options = self.engine_options()
        prefill_replicas = self.prefill_replicas
        if prefill_replicas is None:
            prefill_replicas = int(options.ridgefill or options.prefix_cache_bytes is not None)
        return ClusterConfig(
            model=self.model, attention_shards=self.attention_shards or 1,
            mlp_replicas=self.mlp_replicas or 1, wiring=self.wiring,
            transport=self.transport or "grpc", kv_splits=self.kv_splits,
            kv_cache_bytes=self.kv_cache_bytes, max_num_seqs=self.max_num_seqs,
            dtype=self.dtype_name, quantization=self.quantization, threads=self.torch_threads,
            host=self.host, use_gpu=self.gpu,
            prefill_replicas=prefill_replicas, prefill=options, security=self.grpc_security(),
            drain_timeout_s=self.drain_timeout, otlp_traces_endpoint=self.otlp_traces_endpoint)


def _kind(hint) -> tuple[type, bool]:
    """`str | None` -> (str, True): the type a flag's value has when given, and whether it
    may be None (not given)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (kind,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return kind, True
    return hint, False


_KINDS = {name: _kind(hint) for name, hint in typing.get_type_hints(ServeArgs).items()}


def _check(f: dataclasses.Field, value) -> None:
    """One field's type, choices and range."""
    name, (kind, optional), meta = flag_name(f.name), _KINDS[f.name], f.metadata
    if value is None and optional:
        return
    if kind is bool:
        if not isinstance(value, bool):
            raise FlagError(name, value, f"{name} is true or false, got {value!r}")
        return
    accepted = (int, float) if kind is float else kind
    if not isinstance(value, accepted) or isinstance(value, bool):
        raise FlagError(name, value, f"{name} expects {kind.__name__}, got {value!r}")
    if meta["choices"] is not None and value not in meta["choices"]:
        raise FlagError(name, value, f"{name} must be one of {', '.join(meta['choices'])}, "
                                     f"got {value!r}")
    if kind is not str and not in_range(value, meta["low"], meta["high"]):
        raise FlagError(name, value, f"{name} must be "
                                     f"{describe_range(meta['low'], meta['high'])}, got {value!r}")
