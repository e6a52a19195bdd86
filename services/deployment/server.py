"""Wiring for the embedded deployment: one process, the exact engine behind the gateway."""
from __future__ import annotations

import functools
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry, Gauge

from models import load_model
from services.common.faults import FaultPlan
from services.common.tokenizer import default_temperature, load_tokenizer
from services.deployment.build import EngineOptions, build_engine
from services.gateway.app import Gateway, build_app
from services.engine.backend import EngineBackend
from services.engine.process import EngineProcess
from services.gateway.limits import HttpLimits
from services.gateway.ratelimit import RateLimits
from services.gateway.metrics import GatewayMetrics, Objectives, export_pool_limits


def build_embedded(model_dir: str | Path, served_name: str | None = None,
                   dtype: torch.dtype = torch.float32, options: EngineOptions | None = None,
                   api_key: str | None = None, limits: HttpLimits | None = None,
                   rate_limits: RateLimits | None = None, threads: int | None = None,
                   engine_process: bool = False, chat_template: str | None = None,
                   tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                   responses=None, objectives: Objectives = Objectives(),
                   admin_key: str | None = None, **engine_options):
    """`options` (or its fields as keywords: `prefill`, `prefix_cache_bytes`, ... see
    `EngineOptions`) are the engine's serve flags: `prefill` (--prefill-mode, --maps, ...)
    adds the RidgeFill prefill service, and requests then choose with `prefill_mode` /
    `ridgefill`; `prefix_cache_bytes` (--prefix-cache) turns the prefix cache on, keyed by
    the model's fingerprint and dtype, and requests may set their own `replay_ratio`.
    `limits`, `rate_limits`: the gateway's (`build_app`); the engine's `max_num_seqs` are
    its running slots; `chat_template`, `tool_call_parser`, `reasoning_parser`: the
    gateway's (`Gateway`); `responses`: the `/v1/responses` store (`build_app`);
    `objectives`: the ones /metrics exports (--slo-ttft-ms, --slo-itl-ms); `admin_key`:
    the `/admin/` routes' key (`build_app`).
    `engine_process`: the engine steps in a child process
    (`EngineProcess`) instead of on a thread of this one (`EngineBackend`); `threads`: its
    torch threads (None: as this process has them)."""
    model_dir = Path(model_dir)
    options = options or EngineOptions(**engine_options)
    build = functools.partial(embedded_engine, model_dir, dtype, options, threads)
    if engine_process:
        registry = CollectorRegistry()
        backend = EngineProcess(build, registry)
        max_model_len = backend.max_model_len
    else:
        engine, registry = build()
        backend = EngineBackend(engine, FaultPlan.from_env())     # read once, at start
        max_model_len = engine.max_model_len
    gateway = Gateway(backend, load_tokenizer(model_dir),
                      served_name or model_dir.name, max_model_len,
                      default_temperature(model_dir),
                      metrics=GatewayMetrics(registry, objectives),
                      chat_template=chat_template, tool_call_parser=tool_call_parser,
                      reasoning_parser=reasoning_parser)
    return build_app(gateway, api_key, limits, rate_limits, running_slots=options.max_num_seqs,
                     responses=responses, admin_key=admin_key)


def embedded_engine(model_dir: Path, dtype: torch.dtype, options: EngineOptions,
                    threads: int | None = None):
    """-> (the embedded deployment's engine, the registry its metrics went into); in the
    process that steps it."""
    if threads is not None:
        torch.set_num_threads(threads)
    model = load_model(model_dir, dtype=dtype).quantize(options.quantization)
    if options.compile_decode:
        from services.engine.compiled_decode import use_cache_dir

        use_cache_dir()
    registry = CollectorRegistry()
    engine, _ = build_engine(model, model_dir, options, registry)
    graphs = engine.runner.compiled
    state = Gauge("splitstack_compiled_decode_buckets", "Decode batch buckets of --compile "
                  "by state: built (their steps run as a graph) and pending (still "
                  "compiling; their steps run eagerly meanwhile)", ["state"], registry=registry)
    state.labels("built").set_function(lambda: len(graphs.compiled) if graphs else 0)
    state.labels("pending").set_function(lambda: graphs.pending() if graphs else 0)
    return engine, registry


def build_cluster(config, address: str | None = None, served_name: str | None = None,
                  num_cpus: int | None = None, api_key: str | None = None,
                  limits: HttpLimits | None = None, rate_limits: RateLimits | None = None,
                  max_replicas: int = 8, drain_timeout_s: float = 30.0, autoscaler=None,
                  chat_template: str | None = None, tool_call_parser: str | None = None,
                  reasoning_parser: str | None = None, responses=None,
                  objectives: Objectives = Objectives(), admin_key: str | None = None):
    """The disaggregated deployment: start (or join) Ray, place the pool replicas, the
    prefill replicas and the attention services (`services.deployment.ray_cluster`), and put the
    gateway in front of the attention services. Request prefill fields (`prefill_mode`,
    `ridgefill`, `replay_ratio`) travel to the prefill service, which checks them; every
    gRPC channel carries `config.security`. The pools resize at runtime through the
    gateway's `/admin/pools` (`services.deployment.pools`: at most `max_replicas` members
    each; a leaving member busy past `drain_timeout_s` is killed), and `autoscaler`
    (`services.deployment.autoscale`) resizes the pools it bounds. Returns (app, cluster)."""
    from services.deployment.placement import RayPlacement
    from services.deployment.pools import PoolManager
    from services.deployment.ray_cluster import POOLS, deploy, init_ray
    from services.deployment.members import cluster_client

    model_dir = Path(config.model)
    fixed = fixed_pools(config)
    for pool in (autoscaler.bounds if autoscaler is not None else ()):
        if pool in fixed:
            raise ValueError(f"--autoscale: the {pool} pool cannot be resized: {fixed[pool]}")
    init_ray(address, num_cpus=num_cpus)
    cluster = deploy(config)
    # the objectives the gateway exports to the alert rules and dashboards are the ones
    # the autoscaler targets (both from --slo-ttft-ms and --slo-itl-ms)
    metrics = GatewayMetrics(objectives=objectives)
    backend, routing = cluster_client(cluster.attention_addresses, metrics.registry,
                                      config.security)
    gateway = Gateway(backend, load_tokenizer(model_dir), served_name or model_dir.name,
                      cluster.max_model_len, default_temperature(model_dir), metrics=metrics,
                      chat_template=chat_template, tool_call_parser=tool_call_parser,
                      reasoning_parser=reasoning_parser)
    slots = config.max_num_seqs * config.attention_shards
    app = build_app(gateway, api_key, limits, rate_limits, running_slots=slots,
                    responses=responses, admin_key=admin_key)
    placement = RayPlacement(cluster)
    app.state.pools = PoolManager(placement, routing, placement.members(), max_replicas,
                                  drain_timeout_s, fixed, registry=metrics.registry,
                                  autoscaler=autoscaler, latency=(metrics.ttft, metrics.itl))
    cluster.closers.append(app.state.pools.close)
    bounds = autoscaler.bounds if autoscaler is not None else {}
    export_pool_limits(metrics.registry, {pool: bounds[pool][1] if pool in bounds
                                          else max_replicas
                                          for pool in POOLS if pool not in fixed})
    return app, cluster


def fixed_pools(config) -> dict[str, str]:
    """The pools a deployment cannot resize while serving, with why."""
    if config.transport == "nccl":
        why = "under --transport nccl the NCCL links are made at startup only"
        return {"attention": why, "mlp": why, "prefill": why}
    fixed = {}
    if config.transport == "local":
        fixed["mlp"] = ("the MLP pool runs inside each attention service "
                        "(--transport local)")
    if not config.prefill_replicas:
        fixed["prefill"] = ("this deployment prefills through the MLP pool (started with "
                            "--prefill-replicas 0)")
    return fixed
