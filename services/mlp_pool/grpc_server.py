"""Serves an `MLPPool` over gRPC: one bidirectional stream per client, calls in order."""
from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc
from prometheus_client import CollectorRegistry, generate_latest

from kernels.sampling import SamplingParams
from services.common import local_link, sigterm
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.common.codec import (from_proto, generator_from, generator_state, history_from,
                                   processing_from, stage_parts, to_proto)
from services.common.faults import NO_FAULTS, FaultPlan, InjectedFault
from services.common.grpc_security import INSECURE, GrpcSecurity
from services.mlp_pool.pool import MLPPool

log = logging.getLogger(__name__)


class ReplicaDead(RuntimeError):
    """This replica failed stop: its streams end, and its same-host links close."""


class PoolServicer(pb_grpc.MLPPoolServicer):
    """`nccl`: a `NcclEndpoint`; requests naming an `nccl_peer` get their tensors'
    bytes over that peer's link, and the reply's go back the same way."""

    def __init__(self, pool: MLPPool, nccl=None, registry=None, faults: FaultPlan = NO_FAULTS,
                 on_dead: Callable[[str], None] | None = None, metrics_port: int = 0):
        """`faults`: an injected `pool_call` fault makes this replica fail stop: every
        stream ends UNAVAILABLE (the attention services retry on another replica), later
        ones too, and `on_dead(why)` runs once (a Ray member exits)."""
        self.pool, self.nccl, self.registry = pool, nccl, registry
        self.metrics_port = metrics_port       # where `registry` is served (HTTP)
        self.clients = 0          # open `Calls` streams (a drained replica has none)
        self.calls = 0            # calls being computed
        self.dead: str | None = None
        self._fault = faults.point("pool_call")
        self.on_dead = on_dead
        self._lock = threading.Lock()

    def _die(self, why: str) -> None:
        with self._lock:
            first, self.dead = self.dead is None, self.dead or why
        if first and self.on_dead is not None:
            self.on_dead(why)

    def _count(self, name: str, delta: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + delta)

    def _run(self, req: pb.PoolRequest) -> pb.PoolReply:
        link = self.nccl.link(req.nccl_peer) if req.nccl_peer else None
        get = link.recv if link is not None else from_proto
        if req.HasField("stage"):
            out = self.pool.stage(req.stage.layer, get(req.stage.u), get(req.stage.positions))
            return self._reply(req.id, *stage_parts(out), link)
        if req.HasField("score"):
            out = self.pool.score(get(req.score.u), get(req.score.targets), req.score.k)
            return self._reply(req.id, "score", out, link)
        params = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                 **processing_from(p)) for p in req.final.params]
        gens = [generator_from(p.generator_state) for p in req.final.params]
        histories = [history_from(p) for p in req.final.params]
        tokens, logprobs, logits = self.pool.final(get(req.final.u), params, gens, histories)
        states = [generator_state(g) for g in gens]
        return self._reply(req.id, "final", (tokens, logprobs, logits), link, states)

    @staticmethod
    def _reply(rid: int, kind: str, tensors, link, states=()) -> pb.PoolReply:
        if link is None:
            return pb.PoolReply(id=rid, kind=kind, tensors=[to_proto(t) for t in tensors],
                                generator_states=states)
        from services.common.nccl_transport import meta

        for t in tensors:           # stream-ordered: posted now, delivered in this order
            link.send(t)
        return pb.PoolReply(id=rid, kind=kind, tensors=[meta(t) for t in tensors],
                            generator_states=states)

    def Calls(self, request_iterator, context):
        try:
            yield from self._calls(request_iterator)
        except ReplicaDead as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    def local_calls(self, frames):
        """`Calls` over the same-host link (`local_link`): protobuf bytes in and out; a
        failed stop raises, which closes the link."""
        for reply in self._calls(pb.PoolRequest.FromString(f) for f in frames):
            yield reply.SerializeToString()

    def _calls(self, requests):
        self._count("clients", 1)
        try:
            for req in requests:
                try:
                    self._fault.hit()
                except InjectedFault as exc:
                    self._die(str(exc))
                if self.dead is not None:
                    raise ReplicaDead(f"pool replica {self.pool.name} failed stop: {self.dead}")
                self._count("calls", 1)
                try:
                    reply = self._run(req)
                except Exception as exc:  # the caller retries elsewhere; the stream stays up
                    reply = pb.PoolReply(id=req.id, error=f"{type(exc).__name__}: {exc}")
                finally:
                    self._count("calls", -1)
                yield reply
        finally:
            self._count("clients", -1)

    def Health(self, request, context):
        if self.dead is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"failed stop: {self.dead}")
        return pb.Empty()

    def Stats(self, request, context):
        text = generate_latest(self.registry).decode() if self.registry is not None else ""
        return pb.ServiceMetrics(name=self.pool.name, metrics=text, clients=self.clients,
                                 calls=self.calls, draining=sigterm.draining(),
                                 metrics_port=self.metrics_port)


def serve_pool(pool: MLPPool, address: str = "127.0.0.1:0", max_workers: int = 64,
               nccl=None, batching: bool = True, security: GrpcSecurity = INSECURE,
               faults: FaultPlan = NO_FAULTS, on_dead: Callable[[str], None] | None = None,
               registry: CollectorRegistry | None = None, metrics_port: int = 0):
    """Start a gRPC server for `pool`; returns (server, bound address).

    Each client's stream holds one handler thread, so `max_workers` caps the cache-side
    clients. `batching`: concurrent calls from different clients run as one forward
    (`BatchingPool`, which also records stage latency and batch size, served by `Stats`).
    `nccl`: the replica's `NcclEndpoint`, for the nccl transport. `security`: the token
    calls must carry, and TLS. `faults`, `on_dead`: see `PoolServicer`. `registry`: where
    the stage latency and batch size go (a new one if None), served at `metrics_port`."""
    from services.mlp_pool.batcher import BatchingPool
    from services.mlp_pool.metrics import PoolMetrics

    server = security.server(max_workers, options=[("grpc.max_send_message_length", 512 << 20),
                                                   ("grpc.max_receive_message_length", 512 << 20)])
    registry = registry if registry is not None else CollectorRegistry()
    runner = BatchingPool(pool, metrics=PoolMetrics(registry)) if batching else pool
    servicer = PoolServicer(runner, nccl, registry, faults, on_dead, metrics_port)
    pb_grpc.add_MLPPoolServicer_to_server(servicer, server)
    port = security.add_port(server, address)
    server.start()
    bound = f"{address.rsplit(':', 1)[0]}:{port}"
    if local_link.enabled():
        try:
            listener = local_link.LocalListener(bound, servicer.local_calls, security.token)
        except OSError as exc:       # its name is taken: same-host clients use gRPC
            log.warning("pool replica %s: no same-host link (%s)", bound, exc)
        else:
            stop = server.stop

            def stop_both(grace):     # the link ends with the server, as its streams do
                listener.close()
                return stop(grace)
            server.stop = stop_both
    return server, bound
