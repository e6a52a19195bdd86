"""The prefill service over gRPC (`Prefill` in proto/splitstack.proto); its client is
`services.prefill.client`, the events both ends share `services.prefill.wire`.

A prefill replica runs an exact engine (continuous batching of concurrent prompts, chunked)
built from the server flags: with `--maps` the RidgeFill prefill service, with
`--prefix-cache` the prefix cache and Tail-Replay. Each `Prefill` call becomes a one-token
request with `export_prompt`: when its prompt completes, the engine hands back the prompt's
KV, GDN states and last-row logits, and the call streams them (`wire.export_events`) to the
attention service that will decode the request. Nothing of the request stays on the
replica (its blocks are freed; the prefix cache keeps its own copy of the prompt), so a call
to a replica that dies is simply made again on another (`PrefillClient`).

Contract: the replica's step loop is the only code that touches its engine; handler threads
submit, wait for the one output, and stream it. Cancelling a call aborts its prefill.

Under the `nccl` transport (`PrefillRequest.nccl_peer`) the KV and state events carry
metadata only and a `transfer` event comes before the logits (which stay inline, one row).
The replica keeps the tensors until the caller pulls them (`Pull`): the replica posts one
send per tensor on the peer's link, in event order, and the caller then posts its receives
in the same order. The caller makes one pull at a time per link, so concurrent prompts
cannot interleave on it; a transfer nobody pulls is dropped after `TRANSFER_TTL_S`
(counted in `splitstack_prefill_transfers_expired_total`).
"""
from __future__ import annotations

import itertools
import threading
import time

import grpc
import torch
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry, Counter, Histogram

from kernels.sampling import SamplingParams
from models.config import ModelConfig
from services.common import sigterm, tracing
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.common.codec import options_from_proto, to_proto
from services.common.faults import NO_FAULTS, FaultPlan, InjectedFault
from services.common.messages import EngineDeadError
from services.common.grpc_security import INSECURE, GrpcSecurity
from services.engine.driver import QueueDriver
from services.engine import GenerationParams, LLMEngine
from services.prefill.metrics import PREFILL_BUCKETS
from services.prefill.service import PREFILL_MODES
from services.prefill.wire import GRPC_OPTIONS, export_events

# ---- request fields <-> proto ------------------------------------------------------------
def prefill_params(opts: pb.PrefillOptions) -> GenerationParams:
    """The one-token exporting request a `Prefill` call runs; its prefill fields are
    resolved by the replica's engine on admission. Raises `RequestError` naming what is
    wrong."""
    prefill, replay_ratio = options_from_proto(opts)
    return GenerationParams(max_tokens=1, sampling=SamplingParams(temperature=0.0),
                            ignore_eos=True, prefill=prefill, export_prompt=True,
                            replay_ratio=replay_ratio)


class PendingTransfers:
    """nccl: exports whose tensors wait for the caller's `Pull`, by transfer id. Entries
    older than `ttl_s` are dropped whenever one is added (the caller went away)."""

    def __init__(self, ttl_s: float, expired: Counter | None = None):
        self.ttl_s, self.expired = ttl_s, expired
        self._items: dict[int, tuple[float, str, list[torch.Tensor]]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def put(self, peer: str, tensors: list[torch.Tensor]) -> int:
        now = time.monotonic()
        with self._lock:
            for tid in [t for t, (at, _, _) in self._items.items() if now - at > self.ttl_s]:
                del self._items[tid]
                if self.expired is not None:
                    self.expired.inc()
            tid = next(self._ids)
            self._items[tid] = (now, peer, tensors)
            return tid

    def pop(self, tid: int) -> tuple[str, list[torch.Tensor]] | None:
        with self._lock:
            item = self._items.pop(tid, None)
        return None if item is None else item[1:]

    def __len__(self) -> int:
        return len(self._items)


# ---- server ---------------------------------------------------------------------------
class PrefillServicer(pb_grpc.PrefillServicer):
    """`nccl`: the replica's `NcclEndpoint` (links by caller name), for callers that ask
    for their tensors over NCCL."""

    TRANSFER_TTL_S = 120.0

    def __init__(self, loop: QueueDriver, name: str, registry=None, nccl=None,
                 faults: FaultPlan = NO_FAULTS, metrics_port: int = 0):
        """`faults`: an injected `prefill` fault kills the replica's engine (fail stop: its
        calls end UNAVAILABLE and the attention services retry on another replica);
        `metrics_port`: where `registry` is served (`Stats` says)."""
        self.loop, self.name, self.nccl, self.metrics_port = loop, name, nccl, metrics_port
        self._fault = faults.point("prefill")
        self.registry = registry if registry is not None else CollectorRegistry()
        self.cfg: ModelConfig = loop.engine.model.config
        self.prefills = 0
        self.calls = 0                # `Prefill` calls in flight (a drained replica has none)
        self._lock = threading.Lock()
        r = self.registry
        self.request_seconds = Histogram(
            "splitstack_prefill_request_seconds", "Prefill replica: from a call's arrival to "
            "its prompt's KV being ready (queue + compute), by prefill mode", ["mode"],
            registry=r, buckets=PREFILL_BUCKETS)
        for mode in PREFILL_MODES:
            self.request_seconds.labels(mode)
        self.send_seconds = Histogram(
            "splitstack_prefill_send_seconds", "Prefill replica: streaming a prompt's KV and "
            "states to the attention service", registry=r, buckets=PREFILL_BUCKETS)
        self.prompt_tokens = Counter("splitstack_prefill_prompt_tokens_total",
                                     "Prompt tokens prefilled by this replica", registry=r)
        self.transfers = PendingTransfers(self.TRANSFER_TTL_S, Counter(
            "splitstack_prefill_transfers_expired_total", "nccl: prefilled prompts dropped "
            "because their caller never pulled them", registry=r))

    def Prefill(self, request, context):
        """A SERVER span for the call, in the caller's trace (`tracing`)."""
        span = tracing.tracer().start_span(
            "prefill_replica", context=tracing.extract(context.invocation_metadata()),
            kind=SpanKind.SERVER, attributes={"splitstack.member": self.name,
                                              "gen_ai.usage.prompt_tokens":
                                              len(request.prompt_ids)})
        with self._lock:
            self.calls += 1
        try:
            yield from self._prefill(request, context)
        finally:
            with self._lock:
                self.calls -= 1
            span.end()

    def _prefill(self, request, context):
        start = time.perf_counter()
        ids = list(request.prompt_ids)
        if request.nccl_peer and self.nccl is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"prefill replica {self.name} "
                          "has no NCCL links (start it under --transport nccl)")
        try:
            self._fault.hit()
        except InjectedFault as exc:
            self.loop.kill(exc)
        try:
            sub = self.loop.submit(ids, prefill_params(request.options))
        except ValueError as exc:       # RequestError, PrefillRefused, FillError, ...
            yield pb.PrefillEvent(ack=pb.PrefillAck(
                refused=True, error=str(exc), error_field=getattr(exc, "field", None) or ""))
            return
        except EngineDeadError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill replica {self.name}: {exc}")
        seq_id = sub.seq_id
        context.add_callback(lambda: self.loop.abort(seq_id))   # no-op once finished
        yield pb.PrefillEvent(ack=pb.PrefillAck(num_tokens=len(ids)))
        out = sub.events.get()          # one output: the first token, with the export
        if isinstance(out, EngineDeadError):
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill replica {self.name}: {out}")
        if out.export is None:
            if out.finish_reason != "abort":
                context.abort(grpc.StatusCode.INTERNAL, out.error or "the prefill failed")
            return
        self.prefills += 1
        self.prompt_tokens.inc(len(ids))
        ready = time.perf_counter()
        mode = "exact" if sub.fill is None else "ridgefill"
        self.request_seconds.labels(mode).observe(ready - start)
        if request.nccl_peer:
            from services.common.nccl_transport import meta

            sent: list[torch.Tensor] = []
            yield from export_events(out.export, self.cfg,
                                     lambda t: (sent.append(t), meta(t))[1])
            tid = self.transfers.put(request.nccl_peer, sent)
            yield pb.PrefillEvent(transfer=pb.PrefillTransfer(id=tid, tensors=len(sent)))
        else:
            yield from export_events(out.export, self.cfg)
            self.send_seconds.observe(time.perf_counter() - ready)
        yield pb.PrefillEvent(logits=to_proto(out.export.logits))

    def Pull(self, request, context):
        """nccl: post the sends of transfer `request.transfer` on the caller's link."""
        start = time.perf_counter()
        item = self.transfers.pop(request.transfer)
        if item is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no prefilled prompt {request.transfer} "
                          f"on {self.name} (pulled already, or dropped after "
                          f"{self.TRANSFER_TTL_S:.0f} s)")
        peer, tensors = item
        if peer != request.nccl_peer or len(tensors) != request.tensors:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"transfer {request.transfer} holds {len(tensors)} tensors for "
                          f"{peer!r}, not {request.tensors} for {request.nccl_peer!r}")
        link = self.nccl.link(peer)
        for t in tensors:          # stream-ordered: posted now, delivered in this order
            link.send(t)
        self.send_seconds.observe(time.perf_counter() - start)
        return pb.PullReply(tensors=len(tensors))

    def Stats(self, request, context):
        engine: LLMEngine = self.loop.engine
        return pb.PrefillStats(name=self.name, running=len(self.loop.streams),
                               waiting=len(engine.scheduler.waiting),
                               kv_usage=engine.blocks.usage, prefills=self.prefills,
                               metrics_port=self.metrics_port,
                               calls=self.calls + len(self.transfers),
                               draining=sigterm.draining())

    def Health(self, request, context):
        if not self.loop.alive:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the step loop has stopped: "
                          f"{self.loop.dead}")
        return pb.Empty()


class PrefixCacheServicer(pb_grpc.PrefixCacheServicer):
    """The replica's prefix cache, probed for routing (thread-safe: the cache locks)."""

    def __init__(self, cache):
        self.cache = cache

    def Probe(self, request, context):
        return pb.ProbeReply(resident_tokens=self.cache.resident_tokens(list(request.tokens)))


def serve_prefill(engine: LLMEngine, registry=None,
                  address: str = "127.0.0.1:0", name: str = "prefill-0", max_workers: int = 64,
                  nccl=None, security: GrpcSecurity = INSECURE, faults: FaultPlan = NO_FAULTS,
                  on_dead=None, metrics_port: int = 0):
    """Start the engine's step loop and a gRPC server for it (and for its prefix cache, if
    it has one); returns (server, bound address, loop). Each call in flight holds one
    handler thread. `nccl`: the replica's `NcclEndpoint`, for the nccl transport.
    `security`: the token calls must carry, and TLS. `faults`: injected `engine_step` and
    `prefill` faults; `on_dead`: called once its engine failed stop (a Ray member exits);
    `metrics_port`: where `registry` is served."""
    loop = QueueDriver(engine, f"{name}-steps", faults, on_dead)
    server = security.server(max_workers, options=GRPC_OPTIONS)
    pb_grpc.add_PrefillServicer_to_server(
        PrefillServicer(loop, name, registry, nccl, faults, metrics_port), server)
    if engine.prefix is not None:
        pb_grpc.add_PrefixCacheServicer_to_server(PrefixCacheServicer(engine.prefix.cache),
                                                  server)
    port = security.add_port(server, address)
    server.start()
    return server, f"{address.rsplit(':', 1)[0]}:{port}", loop
