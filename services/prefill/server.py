"""The prefill service over gRPC (`Prefill` in proto/splitstack.proto), and its client.

A prefill replica runs an exact engine (continuous batching of concurrent prompts, chunked)
built from the server flags: with `--maps` the RidgeFill prefill service, with
`--prefix-cache` the prefix cache and Tail-Replay. Each `Prefill` call becomes a one-token
request with `export_prompt`: when its prompt completes, the engine hands back the prompt's
KV, GDN states and last-row logits, and the call streams them

    ack  ->  PromptKV per full-attention layer  ->  PromptState per GDN layer  ->  logits

to the attention service that will decode the request. Nothing of the request stays on the
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
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kernels.sampling import SamplingParams
from models.config import ModelConfig
from services.common import sigterm
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.common.codec import from_proto, options_from_proto, to_proto
from services.common.faults import NO_FAULTS, FaultPlan, InjectedFault
from services.common.messages import EngineDeadError
from services.common.grpc_security import INSECURE, GrpcSecurity
from services.engine.driver import QueueDriver
from services.engine import GenerationParams, LLMEngine, PromptExport
from services.prefill.metrics import PREFILL_BUCKETS
from services.prefill.service import PREFILL_MODES

GRPC_OPTIONS = [("grpc.max_send_message_length", 512 << 20),
                ("grpc.max_receive_message_length", 512 << 20)]


class PrefillRefused(ValueError):
    """The prefill service refused the request (4xx); carries the offending field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name or None


class PrefillFailed(RuntimeError):
    """Every prefill replica tried failed or was unreachable."""


class PrefillCancelled(Exception):
    """The caller cancelled the prefill."""


# ---- request fields <-> proto ------------------------------------------------------------
def prefill_params(opts: pb.PrefillOptions) -> GenerationParams:
    """The one-token exporting request a `Prefill` call runs; its prefill fields are
    resolved by the replica's engine on admission. Raises `RequestError` naming what is
    wrong."""
    prefill, replay_ratio = options_from_proto(opts)
    return GenerationParams(max_tokens=1, sampling=SamplingParams(temperature=0.0),
                            ignore_eos=True, prefill=prefill, export_prompt=True,
                            replay_ratio=replay_ratio)


def export_events(export: PromptExport, cfg: ModelConfig, encode=to_proto):
    """The KV and state events of an export; `encode` turns each tensor into its proto
    (`nccl_transport.meta` for metadata only), called in the order the events carry them."""
    for i, l in enumerate(cfg.full_attention_layers):
        yield pb.PrefillEvent(kv=pb.PromptKV(layer=l, k=encode(export.kv[i, 0]),
                                             v=encode(export.kv[i, 1])))
    for i, l in enumerate(cfg.linear_attention_layers):
        yield pb.PrefillEvent(state=pb.PromptState(layer=l, conv=encode(export.conv[i]),
                                                   recurrent=encode(export.recurrent[i])))


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
                 faults: FaultPlan = NO_FAULTS):
        """`faults`: an injected `prefill` fault kills the replica's engine (fail stop: its
        calls end UNAVAILABLE and the attention services retry on another replica)."""
        self.loop, self.name, self.nccl = loop, name, nccl
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
        with self._lock:
            self.calls += 1
        try:
            yield from self._prefill(request, context)
        finally:
            with self._lock:
                self.calls -= 1

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
        text = generate_latest(self.registry).decode()
        return pb.PrefillStats(name=self.name, running=len(self.loop.streams),
                               waiting=len(engine.scheduler.waiting),
                               kv_usage=engine.blocks.usage, prefills=self.prefills,
                               metrics=text, calls=self.calls + len(self.transfers),
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
                  on_dead=None):
    """Start the engine's step loop and a gRPC server for it (and for its prefix cache, if
    it has one); returns (server, bound address, loop). Each call in flight holds one
    handler thread. `nccl`: the replica's `NcclEndpoint`, for the nccl transport.
    `security`: the token calls must carry, and TLS. `faults`: injected `engine_step` and
    `prefill` faults; `on_dead`: called once its engine failed stop (a Ray member exits)."""
    loop = QueueDriver(engine, f"{name}-steps", faults, on_dead)
    server = security.server(max_workers, options=GRPC_OPTIONS)
    pb_grpc.add_PrefillServicer_to_server(
        PrefillServicer(loop, name, registry, nccl, faults), server)
    if engine.prefix is not None:
        pb_grpc.add_PrefixCacheServicer_to_server(PrefixCacheServicer(engine.prefix.cache),
                                                  server)
    port = security.add_port(server, address)
    server.start()
    return server, f"{address.rsplit(':', 1)[0]}:{port}", loop


# ---- client (the attention service's side) --------------------------------------------
class CancelHandle:
    """Cancels the prefill call in flight, and any retry after it."""

    def __init__(self):
        self.cancelled = False
        self.call = None
        self._lock = threading.Lock()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            if self.call is not None:
                self.call.cancel()

    def attach(self, call) -> None:
        with self._lock:
            self.call = call
            if self.cancelled:
                call.cancel()


class PendingPrefill:
    """A prompt's prefill on a prefill replica, running on its own thread once a replica
    acknowledged it: what an engine's request waits on in WAITING_FOR_REMOTE_KVS (`done`,
    `result`, `cancel`; `add_done_callback` wakes the engine's step loop)."""

    def __init__(self):
        self.handle = CancelHandle()
        self.acked = threading.Event()          # a replica took it (or it ended first)
        self._done = threading.Event()
        self._result: PromptExport | None = None
        self._error: BaseException | None = None
        self._callbacks: list = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> PromptExport:
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> None:
        self.handle.cancel()

    def add_done_callback(self, fn) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def run(self, work) -> None:
        try:
            self._result = work()
        except BaseException as exc:  # noqa: BLE001 — handed to whoever reads `result`
            self._error = exc
        with self._lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        self.acked.set()
        for fn in callbacks:
            fn()


class _Replica:
    """One prefill replica as a client sees it: its channel and stubs, this side's NCCL
    link to it (nccl transport), and the calls in flight there."""

    def __init__(self, address: str, security: GrpcSecurity, link=None):
        self.address, self.link = address, link
        self.channel = security.channel(address, options=GRPC_OPTIONS)
        self.stub = pb_grpc.PrefillStub(self.channel)
        self.probe = pb_grpc.PrefixCacheStub(self.channel)
        self.link_lock = threading.Lock()
        self.inflight = 0
        self.removed = False      # left the client's list; closed once its calls are done


class PrefillClient:
    """Calls the prefill replica with the fewest calls in flight (ties round robin). With
    `cache_aware`, replicas are first probed for the prompt's prefix in their memory tier
    and the one holding the most of it is preferred, unless it has `MAX_SKEW` more calls in
    flight than the least loaded. A replica that cannot be reached, or dies mid-stream, is
    skipped and the prefill made again on the next one: a prefill holds no state.
    Thread-safe; `set_replicas` changes the replicas while prefills run.

    `links` (nccl transport): one `NcclLink` per replica, this side's end, and `peer` the
    name the replicas know this side by; the KV and states then come over the link,
    received on `device`. `security`: the token every call carries (the probes' too), and
    TLS."""

    MAX_SKEW = 4           # calls in flight a cache hit may cost over the least loaded
    PROBE_TIMEOUT_S = 0.5

    def __init__(self, addresses: list[str], cfg: ModelConfig, dtype: torch.dtype,
                 cache_aware: bool = False, links: list | None = None, peer: str = "",
                 device: str | torch.device = "cpu", security: GrpcSecurity = INSECURE):
        if not addresses:
            raise ValueError("a prefill client needs at least one prefill replica")
        if links is not None and (len(links) != len(addresses) or not peer):
            raise ValueError("nccl: give one link per prefill replica and this side's name")
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.links, self.peer = links, peer
        self.cache_aware, self.security = cache_aware, security
        self.replicas = [_Replica(a, security, links[i] if links is not None else None)
                         for i, a in enumerate(addresses)]
        self.retries = 0
        self._turn = itertools.count()
        self._lock = threading.Lock()

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self.replicas]

    def set_replicas(self, addresses: list[str]) -> None:
        """Send new prompts to `addresses` from now on. A replica already in use keeps its
        channel; a removed one finishes the prefills it has in flight, then its channel is
        closed. Under nccl a new replica needs a link the deployment makes: refused."""
        if not addresses:
            raise ValueError("a prefill client needs at least one prefill replica")
        with self._lock:
            current = {r.address: r for r in self.replicas}
            if self.links is not None and set(addresses) - set(current):
                raise NotImplementedError("nccl: a new prefill replica needs a link made by "
                                          "the deployment; replicas join only at startup")
            self.replicas = [current.pop(a, None) or _Replica(a, self.security)
                             for a in addresses]
            for gone in current.values():
                gone.removed = True
                if gone.inflight == 0:
                    gone.channel.close()

    def _resident(self, prompt_ids: list[int],
                  replicas: list[_Replica] | None = None) -> list[int]:
        """Per replica, the prompt's leading tokens in its memory tier (0 if it fails)."""
        request = pb.ProbeRequest(tokens=prompt_ids)
        futures_ = [r.probe.Probe.future(request, timeout=self.PROBE_TIMEOUT_S)
                    for r in (self.replicas if replicas is None else replicas)]
        out = []
        for f in futures_:
            try:
                out.append(f.result().resident_tokens)
            except grpc.RpcError:
                out.append(0)
        return out

    def _order(self, prompt_ids: list[int] | None = None) -> list[_Replica]:
        replicas = self.replicas
        resident = (self._resident(prompt_ids, replicas)
                    if self.cache_aware and len(replicas) > 1 and prompt_ids else None)
        with self._lock:
            turn = next(self._turn)
            n = len(replicas)
            order = sorted(range(n), key=lambda i: (replicas[i].inflight, (i - turn) % n))
            if resident is not None:
                least = replicas[order[0]].inflight
                best = max(order, key=lambda i: resident[i])     # stable: least loaded first
                if resident[best] > 0 and replicas[best].inflight - least < self.MAX_SKEW:
                    order.remove(best)
                    order.insert(0, best)
            return [replicas[i] for i in order]

    def start(self, prompt_ids: list[int], options: pb.PrefillOptions) -> PendingPrefill:
        """`prefill` on a thread of its own; returns once a replica acknowledged the prompt.
        A refusal (`PrefillRefused`), or no replica taking it (`PrefillFailed`), raises
        here; what fails after the acknowledgement is the pending prefill's `result`."""
        pending = PendingPrefill()
        threading.Thread(target=pending.run, daemon=True, name="prefill-call", args=(
            lambda: self.prefill(prompt_ids, options, pending.handle, pending.acked.set),
        )).start()
        pending.acked.wait()
        if pending.done():
            pending.result()                # raises what ended it before a replica took it
        return pending

    def prefill(self, prompt_ids: list[int], options: pb.PrefillOptions,
                cancel: CancelHandle | None = None, acked=None) -> PromptExport:
        request = pb.PrefillRequest(prompt_ids=prompt_ids, options=options,
                                    nccl_peer=self.peer if self.links is not None else "")
        errors, tried = [], set()
        order = self._order(prompt_ids)
        while order:
            replica = order.pop(0)
            if cancel is not None and cancel.cancelled:
                raise PrefillCancelled()
            with self._lock:
                removed = replica.removed
                if not removed:
                    replica.inflight += 1
            if removed:                      # the list changed since `order` was made
                order = [r for r in self._order() if r.address not in tried]
                continue
            tried.add(replica.address)
            try:
                call = replica.stub.Prefill(request)
                if cancel is not None:
                    cancel.attach(call)
                return self._receive(call, len(prompt_ids), replica, acked)
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.CANCELLED:
                    raise PrefillCancelled() from err
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise PrefillFailed(f"prefill replica {replica.address}: "
                                        f"{code.name}: {err.details()}") from err
                errors.append(f"{replica.address}: {err.details()}")
                with self._lock:
                    self.retries += 1
            finally:
                with self._lock:
                    replica.inflight -= 1
                    if replica.removed and replica.inflight == 0:
                        replica.channel.close()
        raise PrefillFailed("no prefill replica is available (" + "; ".join(errors) + ")")

    def _receive(self, call, n: int, replica: _Replica | None = None,
                 acked=None) -> PromptExport:
        cfg = self.cfg
        events = iter(call)
        first = next(events, None)
        if first is None or first.WhichOneof("part") != "ack":
            raise PrefillFailed("the prefill stream did not start with an acknowledgement")
        ack = first.ack
        if ack.refused:
            raise PrefillRefused(ack.error_field, ack.error)
        if acked is not None:
            acked()
        fa = {l: i for i, l in enumerate(cfg.full_attention_layers)}
        gdn = {l: i for i, l in enumerate(cfg.linear_attention_layers)}
        dev = self.device
        kv = torch.empty(len(fa), 2, n, cfg.num_key_value_heads, cfg.head_dim, dtype=self.dtype,
                         device=dev)
        conv = rec = None
        if gdn:
            conv = torch.empty(len(gdn), cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1,
                               dtype=self.dtype, device=dev)
            rec = torch.empty(len(gdn), cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                              cfg.linear_value_head_dim, dtype=torch.float32, device=dev)
        # nccl: (destination, metadata) in event order, the bytes pulled at the end
        parts: list[tuple[torch.Tensor, pb.Tensor]] = []

        def take(dst: torch.Tensor, m: pb.Tensor) -> None:
            if self.links is None:
                dst.copy_(from_proto(m))
            else:
                parts.append((dst, m))
        transfer = None
        seen = set()
        for ev in events:
            part = ev.WhichOneof("part")
            if part == "kv":
                take(kv[fa[ev.kv.layer], 0], ev.kv.k)
                take(kv[fa[ev.kv.layer], 1], ev.kv.v)
                seen.add(ev.kv.layer)
            elif part == "state":
                take(conv[gdn[ev.state.layer]], ev.state.conv)
                take(rec[gdn[ev.state.layer]], ev.state.recurrent)
                seen.add(ev.state.layer)
            elif part == "transfer":
                transfer = ev.transfer
            elif part == "logits":
                if len(seen) != len(fa) + len(gdn):
                    raise PrefillFailed(f"the prefill stream missed layers "
                                        f"{sorted((set(fa) | set(gdn)) - seen)}")
                if self.links is not None:
                    if transfer is None or transfer.tensors != len(parts):
                        raise PrefillFailed("the prefill stream did not announce its transfer")
                    self._pull(replica, transfer.id, parts)
                return PromptExport(kv, conv, rec, from_proto(ev.logits))
        raise PrefillFailed("the prefill stream ended before the logits")

    def _pull(self, replica: _Replica, transfer: int, parts) -> None:
        """nccl: ask the replica to send transfer `transfer`, then receive its tensors in
        order. One pull per link at a time, so concurrent prompts never interleave."""
        with replica.link_lock:
            replica.stub.Pull(pb.PullRequest(transfer=transfer, nccl_peer=self.peer,
                                             tensors=len(parts)))
            for dst, m in parts:
                dst.copy_(replica.link.recv(m))
