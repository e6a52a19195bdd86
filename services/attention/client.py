"""The gateway's side of the attention services: `AttentionClient`, the `EngineClient` of the
disaggregated deployment (routing, relay, migration).

Each request goes to the live attention service with the fewest requests in flight (ties in
turn, `ReplicaSet`), as one server-streaming `Generate` call (grpc.aio, on the gateway's
event loop). The first event acknowledges or refuses the request; a refusal is a
`RequestError` (HTTP 400). Cancelling the call (`abort`, or the client going away) aborts
the request there and frees its KV. A service whose call fails (killed, or failed stop) is
taken out of routing until a health check (`Health`) answers again, and each request it
owned migrates: it is sent again, with the tokens streamed so far, to a live service, which
prefills prompt and tokens and goes on as the uninterrupted run would.

The members export their own metrics where they run (`services.common.member_metrics`); the
gateway's view of them is this client's load figures (`refresh`, polled in the background)
and the pool manager's (`services.deployment.pools`).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc
from prometheus_client import Counter, Gauge, Histogram

from services.common.codec import params_to_proto, prompt_logprobs_from
from services.common import tracing
from services.common.grpc_security import INSECURE, GrpcSecurity
from services.common.messages import (GenerationParams, RequestError, StepOutput,
                                      Unavailable)
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.common.replicas import Replica, ReplicaSet
from services.engine.protocol import EngineClient

log = logging.getLogger(__name__)


class RemoteRequestError(RequestError):
    """A request an attention service refused, with its message as given."""

    def __init__(self, field_name: str, message: str):
        ValueError.__init__(self, message)
        self.field, self.value = field_name or None, None


class Channel:
    """A member's aio channel and stub, made on first use (aio channels bind to the event
    loop), and whether it answers."""

    def __init__(self, address: str, security: GrpcSecurity, stub=pb_grpc.AttentionStub):
        self.address, self.security, self._stub_cls = address, security, stub
        self.channel: grpc.aio.Channel | None = None
        self.stub = None
        self.down_since: float | None = None

    def connect(self):
        if self.channel is None:
            self.channel = self.security.aio_channel(self.address)
            self.stub = self._stub_cls(self.channel)
        return self.stub


def _stage_times(ev: pb.GenerateEvent) -> dict:
    """A first token's queue and prefill seconds, as its attention service measured them."""
    return {name: getattr(ev, name) for name in ("queue_s", "prefill_s") if ev.HasField(name)}


class AttentionClient(EngineClient):
    poll_interval_s = 2.0   # the services' load, polled beside the scrapes
    RECHECK_S = 5.0      # a failed service is probed again after this long
    MAX_MIGRATIONS = 3   # times one request may move to another attention service

    def __init__(self, addresses: list[str], registry=None, security: GrpcSecurity = INSECURE):
        """`registry`: where the migration counter, the pause histogram and the poll's
        time go (the gateway's). `security`: the token every call carries, and TLS."""
        self.security = security
        self.set = ReplicaSet(list(addresses), lambda a: Channel(a, security),
                              what="attention service")
        self._left: list[Replica[Channel]] = []     # out of routing, streams still going
        self.migrations = self.migration_pause = self.polled = None
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
            self.polled = Gauge("splitstack_members_polled_timestamp_seconds", "When the "
                                "last finished poll of the attention services' load began "
                                "(Unix time)", registry=registry)
        self.calls: dict[int, grpc.aio.UnaryStreamCall] = {}
        self._aborted: set[int] = set()   # ids the gateway aborted: never migrated
        self._ids = itertools.count()
        self._usage = 0.0
        self._waiting = self._running = 0

    # ---- routing --------------------------------------------------------------------
    async def _live(self) -> list[Replica[Channel]]:
        """The services in routing that answer, fewest requests in flight first; one down
        for `RECHECK_S` is probed again first."""
        now = time.monotonic()
        for r in self.set.replicas:
            ch = r.conn
            if ch.down_since is not None and now - ch.down_since > self.RECHECK_S:
                try:
                    await ch.connect().Health(pb.Empty(), timeout=1.0)
                    ch.down_since = None
                except grpc.aio.AioRpcError:
                    ch.down_since = now
        return self.set.order(lambda r: r.conn.down_since is None)

    @staticmethod
    def _mark_down(ch: Channel, err: grpc.aio.AioRpcError) -> None:
        if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN,
                          grpc.StatusCode.INTERNAL) and ch.down_since is None:
            log.warning("attention service %s failed: %s", ch.address, err.details())
            ch.down_since = time.monotonic()

    async def submit(self, prompt_ids: list[int],
                     params: GenerationParams) -> tuple[int, asyncio.Queue]:
        """-> (id, asyncio.Queue of StepOutput). Raises RequestError for a refused request
        and `Unavailable` when no attention service is reachable. A request that fails
        before it was acknowledged holds nothing anywhere, so it is tried on the next
        service."""
        request = params_to_proto(prompt_ids, params)
        errors = []
        for r in await self._live():
            call, first = await self._open(r, request)
            if call is None:
                errors.append(f"{r.address}: {first}")
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
            asyncio.ensure_future(self._pump(gid, r, call, queue, request))
            return gid, queue
        raise Unavailable("no attention service is available"
                          + (f" ({'; '.join(errors)})" if errors else ""))

    async def _open(self, r: Replica[Channel], request: pb.GenerateRequest):
        """Start `request` on `r` and read its first event -> (call, event), or (None, why)
        when the service is unreachable, left routing or closed the stream. The call counts
        in flight from the start, so concurrent submits spread, and stops counting unless
        it runs on (acknowledged, not refused, not finished)."""
        if not self.set.begin(r):
            return None, "left routing"
        # the request's trace context (its `llm_request` span, current in the caller's task
        # and in the migrating task it started) goes with the call
        call = r.conn.connect().Generate(request, metadata=tracing.inject())
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as err:
            self.set.end(r)
            self._mark_down(r.conn, err)
            return None, err.details()
        if first is grpc.aio.EOF or first.refused or first.finished:
            self.set.end(r)
            if first is grpc.aio.EOF:
                return None, "closed the stream"
        return call, first

    async def _pump(self, gid: int, r, call, queue: asyncio.Queue,
                    request: pb.GenerateRequest) -> None:
        """Relay `call`'s events as `StepOutput`s, migrating the request when its service
        fails mid-stream (at most `MAX_MIGRATIONS` moves); the client's stream never sees
        the move."""
        try:
            await self._relay(gid, r, call, queue, request)
        finally:
            self._aborted.discard(gid)

    async def _relay(self, gid, r, call, queue, request) -> None:
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
                self._mark_down(r.conn, err)
                reason = f"attention service {r.address} failed: {err.code().name}: " \
                         f"{err.details()}"
            except Exception as err:  # noqa: BLE001 — never leave a request waiting
                reason = f"attention service {r.address}: {err}"
            finally:
                self.set.end(r)
                self.calls.pop(gid, None)
            if gid in self._aborted or attempt == self.MAX_MIGRATIONS:
                break
            log.warning("%s; moving request %d with %d tokens", reason, gid, len(tokens))
            moved_at = moved_at or last_token
            why = "drain" if r.removed else "failure"     # it left routing before it ended
            moved = await self._move(gid, request, tokens, r)
            if isinstance(moved, str):
                reason += f"; {moved}"
                break
            r, call = moved
            if self.migrations is not None:
                self.migrations.labels(why).inc()
        queue.put_nowait(StepOutput(gid, None, None, True, "error", reason))

    async def _move(self, gid: int, request: pb.GenerateRequest, tokens: list[int], failed):
        """Start `request` again, after `tokens`, on the least-loaded other live service:
        -> (replica, call), or why it could not."""
        resumed = pb.GenerateRequest()
        resumed.CopyFrom(request)
        resumed.resume_ids[:] = tokens
        for r in await self._live():
            if r is failed:
                continue
            call, first = await self._open(r, resumed)
            if call is None:
                continue
            if first.refused or first.finished:
                return f"{r.address} refused to continue it: {first.error}"
            self.calls[gid] = call
            return r, call
        return "no live attention service to continue it on"

    # ---- membership (elastic pools; `services.deployment.pools`) ----------------------
    def set_addresses(self, addresses: list[str]) -> None:
        """Route new requests to the attention services at `addresses` from now on (any
        thread). A service left out keeps its streams (`in_flight`); those still running
        when it is killed migrate (reason "drain")."""
        left = self.set.set(list(addresses))
        self._left = [r for r in self._left + left if r.inflight > 0]

    def in_flight(self, address: str) -> int:
        """Requests the gateway has streaming from the attention service at `address`."""
        return sum(r.inflight for r in (*self.set.replicas, *self._left)
                   if r.address == address)

    def abort(self, seq_id: int) -> None:
        self._aborted.add(seq_id)
        call = self.calls.get(seq_id)
        if call is not None:
            call.cancel()

    # ---- health and load --------------------------------------------------------------
    def healthy(self) -> bool:
        return any(r.conn.down_since is None for r in self.set.replicas)

    def kv_usage(self) -> float:
        return self._usage

    def num_running(self) -> int:
        return self._running

    def num_waiting(self) -> int:
        return self._waiting

    async def refresh(self) -> list[pb.AttentionStats]:
        """Poll every live service's stats at once (each within 2 s); the gateway's KV
        gauge is the fullest one."""
        began = time.time()

        async def poll(r) -> tuple[str, pb.AttentionStats | None]:
            try:
                return r.address, await r.conn.connect().Stats(pb.Empty(), timeout=2.0)
            except grpc.aio.AioRpcError as err:
                self._mark_down(r.conn, err)
                return r.address, None

        polled = {address: st for address, st in
                  await asyncio.gather(*(poll(r) for r in await self._live())) if st}
        stats = list(polled.values())
        self._usage = max((s.kv_usage for s in stats), default=0.0)
        self._waiting = sum(s.waiting for s in stats)
        self._running = sum(s.running for s in stats)
        if self.polled is not None:
            self.polled.set(began)
        return stats

    def shutdown(self) -> None:
        for call in list(self.calls.values()):
            call.cancel()
