"""Gateway backend for the disaggregated deployment: attention services over gRPC.

Each request goes to the live attention service with the fewest requests in flight, as one
server-streaming `Generate` call (grpc.aio, on the gateway's event loop). The first event
acknowledges or refuses the request; a refusal is a `RequestError` (HTTP 400). Cancelling
the call (`abort`, or the client going away) aborts the request there and frees its KV. An
attention service that dies fails only the requests it owns, each with an error naming it;
it is taken out of routing until a health check (`Health`) answers again.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from services.common.codec import params_to_proto, prompt_logprobs_from
from services.common.grpc_security import INSECURE, GrpcSecurity
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.common.messages import GenerationParams, RequestError, StepOutput
from services.engine.protocol import EngineClient
from services.gateway.metrics import PolledCounter
from services.gateway.protocol import APIError

log = logging.getLogger(__name__)


class RemoteRequestError(RequestError):
    """A request an attention service refused, with its message as given."""

    def __init__(self, field_name: str, message: str):
        ValueError.__init__(self, message)
        self.field, self.value = field_name or None, None


class _Endpoint:
    def __init__(self, address: str, stub=pb_grpc.AttentionStub,
                 security: GrpcSecurity = INSECURE):
        self.address = address
        self.security = security
        self.channel: grpc.aio.Channel | None = None
        self.stub = None
        self._stub_cls = stub
        self.inflight = 0
        self.down_since: float | None = None
        self.retired = False      # left routing (a draining service); its streams go on

    def connect(self) -> None:
        if self.channel is None:         # created lazily: aio channels bind to the loop
            self.channel = self.security.aio_channel(self.address)
            self.stub = self._stub_cls(self.channel)


def _stage_times(ev: pb.GenerateEvent) -> dict:
    """A first token's queue and prefill seconds, as its attention service measured them."""
    return {name: getattr(ev, name) for name in ("queue_s", "prefill_s") if ev.HasField(name)}


class RemoteMetrics:
    """A collector re-exporting what other services exported (their Prometheus text, as
    polled), each sample labelled with the `service` it came from: the prefill replicas'
    prefill and prefix-cache metrics appear on the gateway's /metrics under their own
    names, so dashboards need no second scrape target."""

    def __init__(self):
        self.latest: dict[str, str] = {}      # service address -> its exposition text

    def collect(self):
        merged: dict[str, Metric] = {}
        for service, text in sorted(self.latest.items()):
            for fam in text_string_to_metric_families(text):
                out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
                for sample in fam.samples:
                    out.add_sample(sample.name, {**sample.labels, "service": service},
                                   sample.value, sample.timestamp)
        yield from merged.values()


class ClusterBackend(EngineClient):
    RECHECK_S = 5.0      # a failed endpoint is probed again after this long
    MAX_MIGRATIONS = 3   # times one request may move to another attention service

    def __init__(self, addresses: list[str], registry=None,
                 prefill_addresses: list[str] = (), pool_addresses: list[str] = (),
                 security: GrpcSecurity = INSECURE):
        """`registry`: where the per-service gauges go (the gateway's, for /metrics).
        `prefill_addresses`, `pool_addresses`: replicas whose metrics it polls and
        re-exports (prefill and prefix cache; pool stage latency and batch size).
        `security`: the token every call carries, and TLS."""
        if not addresses:
            raise ValueError("the gateway needs at least one attention service")
        self.gauges = None
        self.security = security
        self.remote = RemoteMetrics()
        self.peers = ([("prefill", _Endpoint(a, pb_grpc.PrefillStub, security))
                       for a in prefill_addresses]
                      + [("pool", _Endpoint(a, pb_grpc.MLPPoolStub, security))
                         for a in pool_addresses])
        if registry is not None:
            registry.register(self.remote)
            self.peer_up = {kind: Gauge(f"splitstack_{kind}_up",
                                        f"1 while the {kind} replica answers, else 0",
                                        ["service"], registry=registry)
                            for kind in ("prefill", "pool")}
            self.gauges = {
                name: Gauge(f"splitstack_attention_{name}", doc, ["service"], registry=registry)
                for name, doc in (
                    ("up", "1 while the attention service answers, else 0"),
                    ("kv_cache_usage_ratio", "Fraction of KV blocks in use, fullest shard"),
                    ("requests_running", "Requests decoding on the attention service"),
                    ("requests_waiting", "Requests waiting for KV on the attention service"))}
            self.retries = {
                name: PolledCounter(f"splitstack_attention_{name}", doc, ["service"], registry)
                for name, doc in (
                    ("pool_retries", "Pool calls the attention service retried elsewhere"),
                    ("prefill_retries", "Prefill calls made again on another prefill "
                                        "replica"))}
        self.migrations = self.migration_pause = None
        if registry is not None:
            self.migrations = Counter(
                "splitstack_migrations", "Requests moved to another attention service and "
                "continued there", ["reason"], registry=registry)
            for reason in ("failure", "drain"):      # exported at 0 before the first move
                self.migrations.labels(reason)
            self.migration_pause = Histogram(
                "splitstack_migration_pause_seconds", "A migrated request's last token "
                "before the move to its first token after it", registry=registry,
                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.endpoints = [_Endpoint(a, security=security) for a in addresses]
        self._retired: dict[str, _Endpoint] = {}     # out of routing, streams still going
        self.calls: dict[int, grpc.aio.UnaryStreamCall] = {}
        self._aborted: set[int] = set()   # ids the gateway aborted: never migrated
        self._ids = itertools.count()
        self._turn = itertools.count()
        self._usage = 0.0
        self._waiting = 0

    # ---- routing --------------------------------------------------------------------
    async def _live(self) -> list[_Endpoint]:
        now = time.monotonic()
        for ep in self.endpoints:
            if ep.down_since is not None and now - ep.down_since > self.RECHECK_S:
                ep.connect()
                try:
                    await ep.stub.Health(pb.Empty(), timeout=1.0)
                    ep.down_since = None
                except grpc.aio.AioRpcError:
                    ep.down_since = now
        return [ep for ep in self.endpoints if ep.down_since is None]

    def _mark_down(self, ep: _Endpoint, err: grpc.aio.AioRpcError) -> None:
        if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN,
                          grpc.StatusCode.INTERNAL) and ep.down_since is None:
            log.warning("attention service %s failed: %s", ep.address, err.details())
            ep.down_since = time.monotonic()

    async def submit(self, prompt_ids: list[int],
                     params: GenerationParams) -> tuple[int, asyncio.Queue]:
        """-> (id, asyncio.Queue of StepOutput). Raises RequestError for a refused request
        and APIError(503) when no attention service is reachable. A request that fails
        before it was acknowledged holds nothing anywhere, so it is tried on the next
        service."""
        request = params_to_proto(prompt_ids, params)
        errors = []
        live = await self._live()
        turn = next(self._turn)          # ties go round robin
        order = sorted(range(len(live)), key=lambda i: (live[i].inflight,
                                                        (i - turn) % len(live)))
        for ep in (live[i] for i in order):
            call, first = await self._open(ep, request)
            if call is None:
                errors.append(f"{ep.address}: {first}")
                continue
            if first.refused:
                raise RemoteRequestError(first.error_field, first.error)
            gid = next(self._ids)
            queue: asyncio.Queue = asyncio.Queue()
            if first.finished:       # failed before it started (its prefill, say)
                queue.put_nowait(StepOutput(gid, None, None, True, first.finish_reason or
                                            "error", first.error or None))
                return gid, queue
            self.calls[gid] = call
            asyncio.ensure_future(self._pump(gid, ep, call, queue, request))
            return gid, queue
        raise APIError(503, "no attention service is available"
                       + (f" ({'; '.join(errors)})" if errors else ""),
                       type_="service_unavailable")

    async def _open(self, ep: _Endpoint, request: pb.GenerateRequest):
        """Start `request` on `ep` and read its first event -> (call, event), or (None, why)
        when the service is unreachable or closed the stream. `ep.inflight` counts the call
        from the start, so concurrent submits spread, and stops counting it unless it
        runs on (acknowledged, not refused, not finished)."""
        ep.connect()
        ep.inflight += 1
        call = ep.stub.Generate(request)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as err:
            ep.inflight -= 1
            self._mark_down(ep, err)
            return None, err.details()
        if first is grpc.aio.EOF or first.refused or first.finished:
            ep.inflight -= 1
            if first is grpc.aio.EOF:
                return None, "closed the stream"
        return call, first

    async def _pump(self, gid: int, ep: _Endpoint, call, queue: asyncio.Queue,
                    request: pb.GenerateRequest) -> None:
        """Relay `call`'s events as `StepOutput`s. When its attention service fails
        mid-stream, the request migrates: it is sent again, with the tokens streamed so far
        (`resume_ids`), to another live service, which prefills prompt + tokens and goes on
        as the uninterrupted run would (the engine skips a seeded sampler's draws); the
        client's stream never sees the move. At most `MAX_MIGRATIONS` moves."""
        try:
            await self._relay(gid, ep, call, queue, request)
        finally:
            self._aborted.discard(gid)

    async def _relay(self, gid, ep, call, queue, request) -> None:
        tokens: list[int] = []
        moved_at: float | None = None       # when a migration's pause started
        last_token = time.monotonic()
        for attempt in range(self.MAX_MIGRATIONS + 1):
            try:
                while True:
                    ev = await call.read()
                    if ev is grpc.aio.EOF:
                        raise ConnectionError("the stream ended before the request finished")
                    if ev.has_token:
                        tokens.append(ev.token)
                        last_token = time.monotonic()
                        if moved_at is not None:
                            if self.migration_pause is not None:
                                self.migration_pause.observe(last_token - moved_at)
                            moved_at = None
                    if not ev.has_token and not ev.finished:
                        continue             # a migration's acknowledgement
                    top = list(zip(ev.top_tokens, ev.top_logprobs)) if ev.has_token else None
                    queue.put_nowait(StepOutput(gid, ev.token if ev.has_token else None,
                                                ev.logprob if ev.has_token else None,
                                                ev.finished, ev.finish_reason or None,
                                                ev.error or None, top_logprobs=top,
                                                prompt_logprobs=prompt_logprobs_from(ev),
                                                **_stage_times(ev)))
                    if ev.finished:
                        return
            except asyncio.CancelledError:
                return
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.CANCELLED:
                    queue.put_nowait(StepOutput(gid, None, None, True, "abort"))
                    return
                self._mark_down(ep, err)
                reason = f"attention service {ep.address} failed: {err.code().name}: " \
                         f"{err.details()}"
            except Exception as err:  # noqa: BLE001 — never leave a request waiting
                reason = f"attention service {ep.address}: {err}"
            finally:
                ep.inflight -= 1
                self.calls.pop(gid, None)
            if gid in self._aborted or attempt == self.MAX_MIGRATIONS:
                break
            log.warning("%s; moving request %d with %d tokens", reason, gid, len(tokens))
            moved_at = moved_at or last_token
            why = "drain" if ep.retired else "failure"    # it left routing before it ended
            moved = await self._move(gid, request, tokens, ep)
            if isinstance(moved, str):
                reason += f"; {moved}"
                break
            ep, call = moved
            if self.migrations is not None:
                self.migrations.labels(why).inc()
        queue.put_nowait(StepOutput(gid, None, None, True, "error", reason))

    async def _move(self, gid: int, request: pb.GenerateRequest, tokens: list[int],
                    failed: _Endpoint):
        """Start `request` again, after `tokens`, on the least-loaded other live service:
        -> (endpoint, call), or why it could not."""
        resumed = pb.GenerateRequest()
        resumed.CopyFrom(request)
        resumed.resume_ids[:] = tokens
        live = sorted((ep for ep in await self._live() if ep is not failed),
                      key=lambda ep: ep.inflight)
        for ep in live:
            call, first = await self._open(ep, resumed)
            if call is None:
                continue
            if first.refused or first.finished:
                return f"{ep.address} refused to continue it: {first.error}"
            self.calls[gid] = call
            return ep, call
        return "no live attention service to continue it on"

    # ---- membership (elastic pools; `services.deployment.pools`) ----------------------
    def set_addresses(self, addresses: list[str]) -> None:
        """Route new requests to the attention services at `addresses` from now on. Any
        thread may call it: the list is swapped whole. A service left out keeps its streams
        (`in_flight`); those still running when it is killed migrate (reason "drain")."""
        current = {ep.address: ep for ep in self.endpoints}
        endpoints = []
        for address in addresses:
            ep = current.pop(address, None) or self._retired.pop(address, None)
            if ep is None:
                ep = _Endpoint(address, security=self.security)
            ep.retired = False
            endpoints.append(ep)
        for ep in current.values():
            ep.retired = True
            self._retired[ep.address] = ep
        self.endpoints = endpoints
        for address in [a for a, ep in self._retired.items() if ep.inflight == 0]:
            self._forget(self._retired.pop(address), "attention")

    def in_flight(self, address: str) -> int:
        """Requests the gateway has streaming from the attention service at `address`."""
        for ep in (*self.endpoints, *self._retired.values()):
            if ep.address == address:
                return ep.inflight
        return 0

    def set_peers(self, prefill_addresses: list[str], pool_addresses: list[str]) -> None:
        """The prefill and pool replicas whose metrics `refresh` polls (any thread)."""
        current = {(kind, ep.address): ep for kind, ep in self.peers}
        peers = []
        for kind, stub, addresses in (("prefill", pb_grpc.PrefillStub, prefill_addresses),
                                      ("pool", pb_grpc.MLPPoolStub, pool_addresses)):
            for address in addresses:
                peers.append((kind, current.pop((kind, address), None)
                              or _Endpoint(address, stub, self.security)))
        self.peers = peers
        for (kind, _), ep in current.items():
            self._forget(ep, kind)

    def _forget(self, ep: _Endpoint, kind: str) -> None:
        """Drop a member's series: its gauges and re-exported metrics."""
        self.remote.latest.pop(ep.address, None)
        if self.gauges is None:
            return
        gauges = (self.gauges.values() if kind == "attention" else [self.peer_up[kind]])
        for gauge in gauges:
            try:
                gauge.remove(ep.address)
            except KeyError:
                pass

    def abort(self, seq_id: int) -> None:
        self._aborted.add(seq_id)
        call = self.calls.get(seq_id)
        if call is not None:
            call.cancel()

    # ---- health and metrics ---------------------------------------------------------
    def healthy(self) -> bool:
        return any(ep.down_since is None for ep in self.endpoints)

    def kv_usage(self) -> float:
        return self._usage

    def num_running(self) -> int:
        return len(self.calls)

    def num_waiting(self) -> int:
        return self._waiting

    async def refresh(self) -> list[pb.AttentionStats]:
        """Poll every live service's stats; the gateway's KV gauge is the fullest one."""
        polled: dict[str, pb.AttentionStats] = {}
        for ep in await self._live():
            ep.connect()
            try:
                polled[ep.address] = await ep.stub.Stats(pb.Empty(), timeout=2.0)
            except grpc.aio.AioRpcError as err:
                self._mark_down(ep, err)
        stats = list(polled.values())
        self._usage = max((s.kv_usage for s in stats), default=0.0)
        self._waiting = sum(s.waiting for s in stats)
        if self.gauges is not None:
            for ep in self.endpoints:
                self.gauges["up"].labels(ep.address).set(ep.down_since is None)
            for address, st in polled.items():
                for name, value in (("kv_cache_usage_ratio", st.kv_usage),
                                    ("requests_running", st.running),
                                    ("requests_waiting", st.waiting)):
                    self.gauges[name].labels(address).set(value)
                self.retries["pool_retries"].set((address,), st.pool_retries)
                self.retries["prefill_retries"].set((address,), st.prefill_retries)
        for ep in self.endpoints:           # an in-process pool's metrics (--transport local)
            st = polled.get(ep.address)
            if st is not None and st.metrics:
                self.remote.latest[ep.address] = st.metrics
            else:
                self.remote.latest.pop(ep.address, None)
        await self._refresh_peers()
        return stats

    async def _refresh_peers(self) -> None:
        for kind, ep in self.peers:
            ep.connect()
            try:
                st = await ep.stub.Stats(pb.Empty(), timeout=2.0)
            except grpc.aio.AioRpcError:
                up = False
                self.remote.latest.pop(ep.address, None)
            else:
                up = True
                self.remote.latest[ep.address] = st.metrics
            if self.gauges is not None:
                self.peer_up[kind].labels(ep.address).set(up)

    def shutdown(self) -> None:
        for call in list(self.calls.values()):
            call.cancel()
