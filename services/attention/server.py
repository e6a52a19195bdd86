"""Serves an attention service's engine over gRPC (`Attention` in proto/splitstack.proto).

The engine is the one `LLMEngine` with a Q-First runner (`services.attention.runner`).
Contract: one thread (the step loop) is the only code that touches the engine. A gRPC
`Generate` call submits its request to that thread, gets it acknowledged or refused, then
relays one event per token. With prefill replicas, the call first has a replica acknowledge
the prompt (a refusal is the call's), then submits the request, which waits in the
scheduler (WAITING_FOR_REMOTE_KVS) until the prompt's KV arrives: no handler blocks on it. When the call ends early (the client cancelled or went away)
its request is aborted and its KV freed at the next step boundary. When the engine fails
stop (`services.engine.driver`), every call ends UNAVAILABLE, as if the process had been
killed, so the gateway migrates the requests; `Health` answers UNAVAILABLE from then on.
"""
from __future__ import annotations

import logging

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kernels.sampling import SamplingError
from services.common import sigterm, tracing
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.common.codec import params_from_proto, prompt_logprob_fields
from services.common.faults import NO_FAULTS, FaultPlan
from services.common.grpc_security import INSECURE, GrpcSecurity
from services.common.messages import EngineDeadError
from services.engine.driver import QueueDriver
from services.engine import LLMEngine, RequestError, StepOutput
from services.prefill.client import (PrefillCancelled, PrefillClient, PrefillFailed,
                                     PrefillRefused)

log = logging.getLogger(__name__)


class StepLoop(QueueDriver):
    """Drives the attention service's engine; gRPC handler threads submit and abort."""

    def __init__(self, engine: LLMEngine, faults: FaultPlan = NO_FAULTS, on_dead=None):
        super().__init__(engine, "attention-steps", faults, on_dead)


def _refusal(exc: Exception) -> pb.GenerateEvent:
    return pb.GenerateEvent(refused=True, finished=True, finish_reason="error", error=str(exc),
                            error_field=getattr(exc, "field", "") or "")


def _stage_times(out: StepOutput) -> dict:
    """The first token's queue and prefill seconds (a prefill on a prefill replica, waited
    for in WAITING_FOR_REMOTE_KVS, counts as prefill)."""
    if out.queue_s is None:
        return {}
    return {"queue_s": out.queue_s, "prefill_s": out.prefill_s}


class AttentionServicer(pb_grpc.AttentionServicer):
    """`prefill`: a `PrefillClient`; each prompt is then prefilled by the prefill service
    (exact, RidgeFill, prefix cache) before its request is submitted, else here."""

    def __init__(self, loop: StepLoop, name: str, transport: str,
                 prefill: PrefillClient | None = None, metrics_port: int = 0):
        self.loop, self.name, self.transport, self.prefill = loop, name, transport, prefill
        self.metrics_port = metrics_port

    def collect(self):
        """The service's own series, read when its /metrics is scraped."""
        engine = self.loop.engine
        for name, doc, value in (
                ("kv_cache_usage_ratio", "Fraction of KV blocks in use, fullest shard",
                 engine.kv_usage),
                ("requests_running", "Requests decoding on the attention service",
                 len(engine.scheduler.running)),
                ("requests_waiting", "Requests waiting for KV on the attention service",
                 len(engine.scheduler.waiting))):
            yield GaugeMetricFamily(f"splitstack_attention_{name}", doc, value=value)
        yield CounterMetricFamily("splitstack_attention_pool_retries", "Pool calls the "
                                  "attention service retried elsewhere",
                                  value=engine.runner.pool.retries)
        yield CounterMetricFamily("splitstack_attention_prefill_retries", "Prefill calls made "
                                  "again on another prefill replica",
                                  value=self.prefill.retries if self.prefill else 0)

    def Generate(self, request, context):
        """A SERVER span for the call, in the trace the gateway sent (`tracing`); the
        prefill replica's span joins it."""
        span = tracing.tracer().start_span(
            "attention_generate", context=tracing.extract(context.invocation_metadata()),
            kind=SpanKind.SERVER, attributes={
                "splitstack.member": self.name, "gen_ai.usage.prompt_tokens":
                len(request.prompt_ids), "splitstack.resumed_tokens": len(request.resume_ids)})
        try:
            yield from self._generate(request, context, span)
        finally:
            span.end()

    def _generate(self, request, context, span):
        prompt = list(request.prompt_ids)
        extra = {"output_ids": list(request.resume_ids)}      # a migrated request's tokens
        try:
            params = params_from_proto(request)
            extra["grammar"] = self.loop.engine.compile_grammar(params)   # off the loop
            if self.prefill is not None:
                self.loop.engine.validate(prompt, params, remote=True)   # before the prefill
                with trace.use_span(span, end_on_exit=False):     # the call carries it
                    pending = self.prefill.start(prompt + extra["output_ids"],
                                                 request.prefill)
                context.add_callback(pending.cancel)
                pending.add_done_callback(self.loop.wake)    # the step loop may be idle
                extra["remote"] = pending
            sub = self.loop.submit(prompt, params, **extra)
        except (RequestError, SamplingError, PrefillRefused) as exc:
            yield _refusal(exc)
            return
        except EngineDeadError as exc:       # the gateway tries another service
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: {exc}")
        except PrefillCancelled:
            return
        except PrefillFailed as exc:
            yield pb.GenerateEvent(finished=True, finish_reason="error", error=str(exc))
            return
        seq_id = sub.seq_id
        context.add_callback(lambda: self.loop.abort(seq_id))   # no-op once finished
        yield pb.GenerateEvent(seq_id=seq_id)
        while True:
            out: StepOutput = sub.events.get()
            if isinstance(out, EngineDeadError):   # like a killed service: the gateway
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: {out}")  # migrates
            yield pb.GenerateEvent(seq_id=seq_id, has_token=out.token is not None,
                                   token=out.token or 0, logprob=out.logprob or 0.0,
                                   finished=out.finished, finish_reason=out.finish_reason or "",
                                   error=out.error or "",
                                   top_tokens=[t for t, _ in out.top_logprobs or ()],
                                   top_logprobs=[lp for _, lp in out.top_logprobs or ()],
                                   **prompt_logprob_fields(out.prompt_logprobs),
                                   **_stage_times(out))
            if out.finished:
                span.set_attribute("gen_ai.response.finish_reasons", [out.finish_reason or ""])
                return

    def Stats(self, request, context):
        engine = self.loop.engine
        runner = engine.runner
        return pb.AttentionStats(name=self.name, running=len(engine.scheduler.running),
                                 waiting=len(engine.scheduler.waiting),
                                 blocks_total=engine.blocks.num_blocks,
                                 blocks_free=engine.blocks.num_free, kv_usage=engine.kv_usage,
                                 pool_retries=runner.pool.retries, steps=self.loop.stats["steps"],
                                 wiring=runner.wiring, transport=self.transport,
                                 prefill_retries=self.prefill.retries if self.prefill else 0,
                                 metrics_port=self.metrics_port,
                                 draining=sigterm.draining())

    def Health(self, request, context):
        if not self.loop.alive:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the step loop has stopped: "
                          f"{self.loop.dead}")
        return pb.Empty()

    def UpdatePeers(self, request, context):
        """Elastic pools: the pool replica list changes on the step loop between two steps
        (a step's stage calls all go to the replicas it started with); the prefill list at
        once, for prompts not yet sent (those in flight finish where they are)."""
        pool = self.loop.engine.runner.pool
        try:
            if request.pool_addresses:
                if self.transport == "local":
                    raise ValueError("the pool runs inside this attention service "
                                     "(--transport local): it has no replicas to change")
                addresses = list(request.pool_addresses)
                self.loop.call(lambda: pool.set_replicas(addresses))
            if request.prefill_addresses:
                if self.prefill is None:
                    raise ValueError("this attention service prefills through the pool: "
                                     "it was started without prefill replicas")
                self.prefill.set_replicas(list(request.prefill_addresses))
        except (ValueError, NotImplementedError) as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        log.info("%s: %d pool replica(s), %d prefill replica(s)", self.name,
                 len(pool.replicas), len(self.prefill.replicas) if self.prefill else 0)
        return pb.PeersReply(pool_replicas=len(pool.replicas),
                             prefill_replicas=len(self.prefill.replicas) if self.prefill else 0)


def serve_attention(engine: LLMEngine, address: str = "127.0.0.1:0",
                    name: str = "attention-0", transport: str = "local",
                    max_workers: int = 64, prefill: PrefillClient | None = None,
                    registry=None, security: GrpcSecurity = INSECURE,
                    faults: FaultPlan = NO_FAULTS, on_dead=None, metrics_port: int = 0):
    """Start the step loop and a gRPC server for it; returns (server, bound address, loop).
    Each in-flight request holds one handler thread, so `max_workers` caps concurrency.
    `registry`: this process's metrics (its engine's, an in-process pool's), to which the
    service's own series are added; `metrics_port`: where they are served (`Stats` says).
    `security`: the token calls must carry, and TLS. `faults`: injected `engine_step`
    faults; `on_dead`: called once the engine failed stop (its requests' calls have ended
    UNAVAILABLE, so the gateway migrates them; a Ray member then exits)."""
    loop = StepLoop(engine, faults, on_dead)
    server = security.server(max_workers)
    servicer = AttentionServicer(loop, name, transport, prefill, metrics_port)
    if registry is not None:
        registry.register(servicer)
    pb_grpc.add_AttentionServicer_to_server(servicer, server)
    port = security.add_port(server, address)
    server.start()
    return server, f"{address.rsplit(':', 1)[0]}:{port}", loop
