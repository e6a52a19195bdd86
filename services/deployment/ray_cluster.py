"""The disaggregated deployment on Ray: MLP pool replicas and attention services as actors.

Each actor loads the checkpoint, keeps only its side's weights (`models.split`) and serves
its own gRPC endpoint on the actor's host; Ray places the actors, keeps their handles and
reports their addresses (discovery). The gateway (in the driver) talks gRPC to the attention
services, each attention service talks to every pool replica over the configured transport:

    gateway ──gRPC stream per request──► attention-i (owns its requests and their KV,
                                                      split over `kv_splits` shards)
    attention-i ──transport, one exchange per stage──► pool-0 … pool-{M−1}
    attention-i ──gRPC stream per prompt──► prefill-0 … prefill-{P−1}   (with P ≥ 1)

With `prefill_replicas` P ≥ 1, every prompt is prefilled by a prefill replica (a whole-model
engine with the RidgeFill prefill service and the prefix cache when configured, see
`services.prefill.server`), whose KV and GDN states the attention service stores before it
decodes; with P = 0 the attention service prefills through the pool itself (exact only).
Under `nccl` the prompt's KV and states come over NCCL too (one link per attention service
and prefill replica; the gRPC stream carries only metadata and the logits).

`local` puts `mlp_replicas` pools inside each attention actor (no pool actors); `grpc` and
`nccl` use pool actors. A dead pool replica's calls are retried on another; a dead attention
service's requests migrate to another (`services.attention.client`). A member that
fails stop (its engine cannot step, an injected fault: `services.common.faults`) ends its
calls UNAVAILABLE, which its callers treat as its death, and exits; the pool manager places
a replacement. SIGTERM to a member's process drains it (`services.common.sigterm`).

Ray stays on loopback when `RAY_ENV` is in the environment of the process that starts it
(Ray binds every interface and advertises the external address otherwise); never `ray stop` — `shutdown()` ends only what this driver started.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from services.common import tracing
from services.common.faults import ENV as FAULTS_ENV
from services.common.faults import FaultPlan
from services.common.grpc_security import INSECURE, GrpcSecurity
from services.common.process import tune_process
from services.common.sigterm import drain_on_sigterm, exit_soon
from services.deployment.build import EngineOptions, grammars_for

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}
TRANSPORT_NAMES = ("local", "grpc", "nccl")
POOLS = ("attention", "mlp", "prefill")
# members a local cluster can hold per pool (each member asks for one unit of its pool's
# resource; on Kubernetes each pool's worker group declares its own)
LOCAL_POOL_SLOTS = 64
# a member told to leave (SIGTERM) exits by itself this long after --drain-timeout, by
# which time the pool manager has normally migrated what it had and killed it
DRAIN_MARGIN_S = 5.0


def pool_resource(pool: str) -> str:
    """The Ray custom resource a member of `pool` asks for: it lands where that resource is
    (a KubeRay worker group per pool), and waits (`pending`) where none is free."""
    return f"splitstack_{pool}"


@dataclass
class ClusterConfig:
    model: str
    attention_shards: int = 1          # attention services (each owns its requests)
    mlp_replicas: int = 1
    wiring: str | None = None          # None: what the checkpoint was trained for
    transport: str = "grpc"
    kv_splits: int = 1                 # KV shards inside one attention service
    kv_cache_bytes: int = 1 << 30      # per attention service, over its KV shards
    block_size: int = 16
    max_num_seqs: int = 16
    dtype: str = "float32"
    quantization: str | None = None    # int8: int8 decode products (every member)
    threads: int = 1                   # torch threads per actor
    host: str = "127.0.0.1"            # where actors bind gRPC (0.0.0.0: all, node IP shown)
    use_gpu: bool = False              # one GPU per actor (required by `nccl`)
    prefill_replicas: int = 0          # prefill service replicas (0: prefill via the pool)
    # the prefill replicas' engines (the attention services take `speculative` and
    # `structured_backend` from it too)
    prefill: EngineOptions = field(default_factory=EngineOptions)
    # the internal gRPC channels' token and TLS (`splitstack serve` always sets a token)
    security: GrpcSecurity = INSECURE
    # a member process that got SIGTERM exits by itself after this, if not stopped before
    drain_timeout_s: float = 30.0
    # injected faults for every member (`services.common.faults`; entries scoped
    # `@member-name` reach only that member): the gateway's SPLITSTACK_FAULT_INJECT
    fault_inject: str = field(default_factory=lambda: os.environ.get(FAULTS_ENV, ""))
    # where the attention services and prefill replicas export their spans (OTLP/gRPC)
    otlp_traces_endpoint: str | None = None

    def __post_init__(self):
        if self.transport not in TRANSPORT_NAMES:
            raise ValueError(f"--transport must be one of {TRANSPORT_NAMES}, "
                             f"got {self.transport!r}")
        if self.wiring not in (None, "standard", "qfirst"):
            raise ValueError(f"--wiring must be standard or qfirst, got {self.wiring!r}")
        for name in ("attention_shards", "mlp_replicas", "kv_splits", "block_size",
                     "max_num_seqs", "threads", "kv_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prefill_replicas < 0:
            raise ValueError("prefill_replicas must be at least 0")
        p = self.prefill
        if not self.prefill_replicas and p.prefix_cache_bytes is not None:
            raise ValueError("the prefix cache lives in the prefill service: give it at "
                             "least one replica (--prefill-replicas)")
        if not self.prefill_replicas and p.ridgefill and self.transport != "local":
            raise ValueError("RidgeFill needs the whole model: give the prefill service at "
                             "least one replica (--prefill-replicas), or hold the pool in "
                             "each attention service (--transport local)")
        FaultPlan.parse(self.fault_inject)          # a malformed entry: refused here
        if self.transport == "nccl" and not self.use_gpu:
            raise ValueError("--transport nccl moves tensors between GPU actors; it needs "
                             "--gpu (one CUDA device per actor)")


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Start a local Ray cluster on loopback, or join `address`; a no-op if already up."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
        return
    temp = Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "splitstack-ray"
    temp.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
             _temp_dir=str(temp), _node_ip_address="127.0.0.1", log_to_driver=False,
             resources={pool_resource(p): LOCAL_POOL_SLOTS for p in POOLS})


def _advertised(address: str) -> str:
    """A bound `host:port` as peers should dial it: a wildcard bind (0.0.0.0, on a
    multi-node cluster) is advertised as this node's IP."""
    host, port = address.rsplit(":", 1)
    if host in ("0.0.0.0", "", "[::]"):
        import ray

        host = ray.util.get_node_ip_address()
    return f"{host}:{port}"


def _load(model_dir: str, dtype: str, side: str, threads: int, device: str = "cpu",
          quantization: str | None = None):
    import torch

    from models import load_model
    from models.split import keep_side

    torch.set_num_threads(threads)
    model = load_model(model_dir, dtype=getattr(torch, dtype), device=device)
    keep_side(model, side)
    return model.quantize(quantization)


class PoolReplica:
    """Ray actor: one stateless MLP pool replica behind a gRPC server."""

    def __init__(self, model_dir: str, name: str, dtype: str = "float32", threads: int = 1,
                 host: str = "127.0.0.1", use_gpu: bool = False,
                 security: GrpcSecurity = INSECURE, drain_timeout_s: float = 30.0,
                 quantization: str | None = None, fault_inject: str = ""):
        from prometheus_client import CollectorRegistry

        from services.common.member_metrics import MemberExporter
        from services.mlp_pool import MLPPool
        from services.mlp_pool.grpc_server import serve_pool

        tune_process()
        drain_on_sigterm(drain_timeout_s + DRAIN_MARGIN_S, name)
        device = "cuda" if use_gpu else "cpu"
        self.name = name
        self.pool = MLPPool(_load(model_dir, dtype, "pool", threads, device, quantization), name)
        self.nccl = None
        if use_gpu:
            from services.common.nccl_transport import NcclEndpoint

            self.nccl = NcclEndpoint()
        registry = CollectorRegistry()
        self.metrics = MemberExporter(registry, host)
        self.server, bound = serve_pool(self.pool, f"{host}:0", nccl=self.nccl,
                                        security=security,
                                        faults=FaultPlan.parse(fault_inject, name),
                                        on_dead=lambda why: exit_soon(name, why),
                                        registry=registry, metrics_port=self.metrics.port)
        self.addr = self.metrics.member = _advertised(bound)

    def address(self) -> str:
        return self.addr

    def calls(self) -> int:
        return self.pool.calls

    def pid(self) -> int:
        return os.getpid()

    def nccl_listen(self, peer: str):
        """`nccl` transport: a communicator id for cache-side peer `peer`, which this
        replica is joining as rank 1."""
        if self.nccl is None:
            raise RuntimeError("the nccl transport needs pool replicas started with use_gpu")
        return self.nccl.listen(peer)


class PrefillReplica:
    """Ray actor: one prefill replica (a whole-model engine with the RidgeFill service and
    the prefix cache as configured) behind a gRPC server."""

    def __init__(self, config: ClusterConfig, name: str):
        import torch
        from prometheus_client import CollectorRegistry

        from models import load_model
        from services.common.member_metrics import MemberExporter
        from services.deployment.build import build_engine
        from services.prefill.server import serve_prefill

        tune_process()
        c = config
        drain_on_sigterm(c.drain_timeout_s + DRAIN_MARGIN_S, name)
        tracing.configure(c.otlp_traces_endpoint, "splitstack-prefill")
        torch.set_num_threads(c.threads)
        model = load_model(c.model, dtype=getattr(torch, c.dtype),
                           device="cuda" if c.use_gpu else "cpu").quantize(c.quantization)
        registry = CollectorRegistry()
        self.engine, _ = build_engine(model, c.model, c.prefill, registry, structured=False)
        self.nccl = None
        if c.transport == "nccl":      # KV and states go to the attention services over NCCL
            from services.common.nccl_transport import NcclEndpoint

            self.nccl = NcclEndpoint()
        self.metrics = MemberExporter(registry, c.host)
        self.server, bound, self.loop = serve_prefill(
            self.engine, registry, f"{c.host}:0", name, nccl=self.nccl,
            security=c.security, faults=FaultPlan.parse(c.fault_inject, name),
            on_dead=lambda dead: exit_soon(name, str(dead)), metrics_port=self.metrics.port)
        self.addr = self.metrics.member = _advertised(bound)
        self.name = name

    def address(self) -> str:
        return self.addr

    def nccl_listen(self, peer: str):
        """`nccl` transport: a communicator id for attention service `peer`, which this
        replica is joining as rank 1."""
        if self.nccl is None:
            raise RuntimeError("this prefill replica was not started under --transport nccl")
        return self.nccl.listen(peer)

    def pid(self) -> int:
        return os.getpid()

    def blocks(self) -> tuple[int, int]:
        """(free, total) KV blocks of its engine once its prefills are done: the leak check."""
        self.engine.blocks.check()
        return self.engine.blocks.num_free, self.engine.blocks.num_blocks


class AttentionReplica:
    """Ray actor: one attention service (its KV shards, its requests) behind a gRPC server."""

    def __init__(self, config: ClusterConfig, name: str, pools: list | None = None,
                 pool_addresses: list[str] | None = None,
                 prefill_addresses: list[str] | None = None, prefills: list | None = None):
        from services.attention.runner import qfirst_engine
        from services.attention.server import serve_attention
        from services.common.member_metrics import MemberExporter
        from services.common.tokenizer import eos_token_ids
        from services.deployment.transports import make_transport
        from services.deployment.build import build_prefill_service
        from services.mlp_pool import MLPPool

        tune_process()
        c = config
        drain_on_sigterm(c.drain_timeout_s + DRAIN_MARGIN_S, name)
        tracing.configure(c.otlp_traces_endpoint, "splitstack-attention")
        device = "cuda" if c.use_gpu else "cpu"
        from prometheus_client import CollectorRegistry

        from services.engine.metrics import EngineCollector

        if c.transport == "local":   # the pool lives in this process: one model, both sides
            import torch

            from models import load_model
            from services.mlp_pool.metrics import MeteredPool, PoolMetrics

            torch.set_num_threads(c.threads)
            model = load_model(c.model, dtype=getattr(torch, c.dtype),
                               device=device).quantize(c.quantization)
            registry = CollectorRegistry()
            metrics = PoolMetrics(registry)
            replicas = [MeteredPool(MLPPool(model, f"{name}-pool-{i}"), metrics)
                        for i in range(c.mlp_replicas)]
            service = None if prefill_addresses else \
                build_prefill_service(model, c.model, c.prefill, registry)   # RidgeFill here
        else:
            registry, service = CollectorRegistry(), None
            model = _load(c.model, c.dtype, "attention", c.threads, device, c.quantization)
            replicas = list(pool_addresses)
        cfg = model.config
        if c.transport == "nccl":
            from services.common.nccl_transport import NcclTransport

            transport = NcclTransport.connect(name, list(pools), replicas, c.security)
        else:
            transport = make_transport(c.transport, replicas, c.security)
        self.engine = qfirst_engine(model, transport, num_shards=c.kv_splits,
                                    block_size=c.block_size, wiring=c.wiring,
                                    eos_token_ids=eos_token_ids(c.model),
                                    kv_cache_bytes=c.kv_cache_bytes,
                                    max_num_seqs=c.max_num_seqs, prefill_service=service,
                                    speculative=c.prefill.speculative,
                                    shard_names=[f"{name}-kv-{i}" for i in range(c.kv_splits)],
                                    grammars=grammars_for(c.model, cfg.vocab_size, registry,
                                                          backend=c.prefill.structured_backend))
        registry.register(EngineCollector(self.engine))
        self.metrics = MemberExporter(registry, c.host)
        prefill = None
        if prefill_addresses:
            from services.prefill.client import PrefillClient

            links = None
            if c.transport == "nccl":
                import ray

                from services.common.nccl_transport import NcclLink

                links = [NcclLink(uid, rank=0)
                         for uid in ray.get([p.nccl_listen.remote(name) for p in prefills])]
            prefill = PrefillClient(prefill_addresses, cfg, model.dtype,
                                    cache_aware=c.prefill.prefix_cache_bytes is not None,
                                    links=links, peer=name, device=device,
                                    security=c.security)
        self.server, bound, self.loop = serve_attention(
            self.engine, f"{c.host}:0", name=name, transport=c.transport, prefill=prefill,
            registry=registry, security=c.security,
            faults=FaultPlan.parse(c.fault_inject, name),
            on_dead=lambda dead: exit_soon(name, str(dead)), metrics_port=self.metrics.port)
        self.addr = self.metrics.member = _advertised(bound)
        self.name = name

    def address(self) -> str:
        return self.addr

    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def pid(self) -> int:
        return os.getpid()

    def blocks(self) -> tuple[int, int]:
        """(free, total) KV blocks of its engine (each spans every KV shard): the leak
        check."""
        self.engine.blocks.check()
        return self.engine.blocks.num_free, self.engine.blocks.num_blocks


@dataclass
class Cluster:
    """Handles of a running deployment (the driver owns the actors)."""
    config: ClusterConfig
    pools: list = field(default_factory=list)
    attention: list = field(default_factory=list)
    attention_addresses: list[str] = field(default_factory=list)
    pool_addresses: list[str] = field(default_factory=list)
    prefills: list = field(default_factory=list)
    prefill_addresses: list[str] = field(default_factory=list)
    max_model_len: int = 0
    starting: list = field(default_factory=list)    # members placed at runtime, not ready
    closers: list = field(default_factory=list)     # called first by `shutdown`

    def shutdown(self) -> None:
        import ray

        for close in self.closers:
            close()
        for actor in self.attention + self.pools + self.prefills + self.starting:
            ray.kill(actor, no_restart=True)


def actor_options(config: ClusterConfig, pool: str) -> dict:
    """Ray options of a `pool` member: no CPU reservation (actors set their own torch
    threads), a GPU under `use_gpu`, never restarted (a restarted member would come back
    with a new address; the pool places a new one instead), and always one unit of its
    pool's resource. Asking only when the cluster already declares it would race: a
    gateway that reaches `deploy()` before the worker pods join would place members on
    itself, on the head or in another pool's group. A member waits (`pending`) until a
    node offering the resource joins; every cluster splitstack starts declares them
    (`init_ray`, the chart's worker groups)."""
    return {"num_cpus": 0, "num_gpus": 1 if config.use_gpu else 0, "max_restarts": 0,
            "max_concurrency": 8, "resources": {pool_resource(pool): 1}}


def place_pool(config: ClusterConfig, name: str):
    """Start one MLP pool replica actor (its address once it serves: `.address.remote()`)."""
    import ray

    return ray.remote(**actor_options(config, "mlp"))(PoolReplica).remote(
        config.model, name, config.dtype, config.threads, config.host, config.use_gpu,
        config.security, config.drain_timeout_s, config.quantization, config.fault_inject)


def place_prefill(config: ClusterConfig, name: str):
    import ray

    return ray.remote(**actor_options(config, "prefill"))(PrefillReplica).remote(config, name)


def place_attention(config: ClusterConfig, name: str, pools: list, pool_addresses: list[str],
                    prefill_addresses: list[str], prefills: list):
    import ray

    return ray.remote(**actor_options(config, "attention"))(AttentionReplica).remote(
        config, name, pools, pool_addresses, prefill_addresses, prefills)


def deploy(config: ClusterConfig) -> Cluster:
    """Place the pool replicas, then the attention services, and wait until all serve."""
    import ray

    cluster = Cluster(config)
    if config.transport != "local":
        cluster.pools = [place_pool(config, f"pool-{i}") for i in range(config.mlp_replicas)]
        cluster.pool_addresses = ray.get([p.address.remote() for p in cluster.pools])
    try:
        if config.prefill_replicas:
            cluster.prefills = [place_prefill(config, f"prefill-{i}")
                                for i in range(config.prefill_replicas)]
            cluster.prefill_addresses = ray.get([p.address.remote() for p in cluster.prefills])
        cluster.attention = [place_attention(config, f"attention-{i}", cluster.pools,
                                             cluster.pool_addresses, cluster.prefill_addresses,
                                             cluster.prefills)
                             for i in range(config.attention_shards)]
        cluster.attention_addresses = ray.get([a.address.remote() for a in cluster.attention])
    except Exception:     # a wiring the checkpoint was not trained for, maps for another...
        cluster.shutdown()
        raise
    cluster.max_model_len = min(ray.get([a.max_model_len.remote() for a in cluster.attention]))
    return cluster
