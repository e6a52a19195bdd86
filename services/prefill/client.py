"""The attention service's side of the prefill service: `PrefillClient` sends each prompt
to a prefill replica and receives its KV, GDN states and logits (`services.prefill.wire`).

A prompt goes to the replica with the fewest prefills in flight (ties in turn) or, with
`cache_aware`, to the one holding most of its prefix. A replica that cannot be reached or
dies mid-stream is skipped and the prefill made again on the next one: a prefill holds no
state. `start` returns once a replica acknowledged the prompt and leaves the rest to a
`PendingPrefill`, which the request waits on in its engine's scheduler
(WAITING_FOR_REMOTE_KVS).
"""
from __future__ import annotations

import threading

import grpc
import torch

from models.config import ModelConfig
from services.common import tracing
from services.common.codec import from_proto
from services.common.grpc_security import INSECURE, GrpcSecurity
from services.common.messages import PromptExport
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.common.replicas import Replica, ReplicaSet
from services.prefill.wire import GRPC_OPTIONS, ExportBuffers


class PrefillRefused(ValueError):
    """The prefill service refused the request (4xx); carries the offending field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name or None


class PrefillFailed(RuntimeError):
    """Every prefill replica tried failed or was unreachable."""


class PrefillCancelled(Exception):
    """The caller cancelled the prefill."""


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


class _Conn:
    """One prefill replica's channel and stubs, and this side's NCCL link to it."""

    def __init__(self, address: str, security: GrpcSecurity, link=None):
        self.link = link
        self.channel = security.channel(address, options=GRPC_OPTIONS)
        self.stub = pb_grpc.PrefillStub(self.channel)
        self.probe = pb_grpc.PrefixCacheStub(self.channel)
        self.link_lock = threading.Lock()


class PrefillClient:
    """Thread-safe; `set_replicas` changes the replicas while prefills run.

    `links` (nccl transport): one `NcclLink` per replica, this side's end, and `peer` the
    name the replicas know this side by; the KV and states then come over the link,
    received on `device`. `security`: the token every call carries (the probes' too), and
    TLS."""

    MAX_SKEW = 4           # calls in flight a cache hit may cost over the least loaded
    PROBE_TIMEOUT_S = 0.5

    def __init__(self, addresses: list[str], cfg: ModelConfig, dtype: torch.dtype,
                 cache_aware: bool = False, links: list | None = None, peer: str = "",
                 device: str | torch.device = "cpu", security: GrpcSecurity = INSECURE):
        if links is not None and (len(links) != len(addresses) or not peer):
            raise ValueError("nccl: give one link per prefill replica and this side's name")
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.links, self.peer = links, peer
        self.cache_aware = cache_aware
        link = dict(zip(addresses, links or ()))
        self.set = ReplicaSet(addresses, lambda a: _Conn(a, security, link.get(a)),
                              lambda conn: conn.channel.close(), "prefill replica")

    @property
    def replicas(self) -> list[Replica[_Conn]]:
        return self.set.replicas

    @property
    def retries(self) -> int:
        return self.set.retried

    def set_replicas(self, addresses: list[str]) -> None:
        """Send new prompts to `addresses` from now on; a removed replica finishes the
        prefills it has in flight. Under nccl a new replica needs a link the deployment
        makes: refused."""
        if self.links is not None and set(addresses) - set(self.set.addresses):
            raise NotImplementedError("nccl: a new prefill replica needs a link made by "
                                      "the deployment; replicas join only at startup")
        self.set.set(addresses)

    def _order(self, prompt_ids: list[int] | None = None) -> list[Replica[_Conn]]:
        """Fewest in flight first; with `cache_aware`, the replica whose memory tier holds
        most of the prompt's prefix first, unless it has `MAX_SKEW` more calls in flight
        than the least loaded."""
        order = self.set.order()
        if not (self.cache_aware and len(order) > 1 and prompt_ids):
            return order
        resident = self._resident(prompt_ids, order)
        best = max(range(len(order)), key=lambda i: resident[i])   # least loaded on a tie
        if resident[best] > 0 and order[best].inflight - order[0].inflight < self.MAX_SKEW:
            order.insert(0, order.pop(best))
        return order

    def _resident(self, prompt_ids: list[int],
                  replicas: list[Replica[_Conn]] | None = None) -> list[int]:
        """Per replica, the prompt's leading tokens in its memory tier (0 if it fails)."""
        request = pb.ProbeRequest(tokens=prompt_ids)
        futures = [r.conn.probe.Probe.future(request, timeout=self.PROBE_TIMEOUT_S)
                   for r in (self.replicas if replicas is None else replicas)]
        out = []
        for f in futures:
            try:
                out.append(f.result().resident_tokens)
            except grpc.RpcError:
                out.append(0)
        return out

    def start(self, prompt_ids: list[int], options: pb.PrefillOptions) -> PendingPrefill:
        """`prefill` on a thread of its own; returns once a replica acknowledged the prompt.
        A refusal (`PrefillRefused`), or no replica taking it (`PrefillFailed`), raises
        here; what fails after the acknowledgement is the pending prefill's `result`."""
        pending = PendingPrefill()
        metadata = tracing.inject()          # the caller's trace, for the replica's span
        threading.Thread(target=pending.run, daemon=True, name="prefill-call", args=(
            lambda: self.prefill(prompt_ids, options, pending.handle, pending.acked.set,
                                 metadata),
        )).start()
        pending.acked.wait()
        if pending.done():
            pending.result()                # raises what ended it before a replica took it
        return pending

    def prefill(self, prompt_ids: list[int], options: pb.PrefillOptions,
                cancel: CancelHandle | None = None, acked=None,
                metadata: list[tuple[str, str]] = ()) -> PromptExport:
        request = pb.PrefillRequest(prompt_ids=prompt_ids, options=options,
                                    nccl_peer=self.peer if self.links is not None else "")
        errors, tried = [], set()
        order = self._order(prompt_ids)
        while order:
            replica = order.pop(0)
            if cancel is not None and cancel.cancelled:
                raise PrefillCancelled()
            if not self.set.begin(replica):      # the list changed since `order` was made
                order = [r for r in self._order() if r.address not in tried]
                continue
            tried.add(replica.address)
            try:
                call = replica.conn.stub.Prefill(request, metadata=metadata)
                if cancel is not None:
                    cancel.attach(call)
                return self._receive(call, len(prompt_ids), replica.conn, acked)
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.CANCELLED:
                    raise PrefillCancelled() from err
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise PrefillFailed(f"prefill replica {replica.address}: "
                                        f"{code.name}: {err.details()}") from err
                errors.append(f"{replica.address}: {err.details()}")
                self.set.retry()
            finally:
                self.set.end(replica)
        raise PrefillFailed("no prefill replica is available (" + "; ".join(errors) + ")")

    def _receive(self, call, n: int, conn: _Conn, acked=None) -> PromptExport:
        events = iter(call)
        first = next(events, None)
        if first is None or first.WhichOneof("part") != "ack":
            raise PrefillFailed("the prefill stream did not start with an acknowledgement")
        if first.ack.refused:
            raise PrefillRefused(first.ack.error_field, first.ack.error)
        if acked is not None:
            acked()
        buffers = ExportBuffers(self.cfg, n, self.dtype, self.device)
        parts: list[tuple[torch.Tensor, pb.Tensor]] = []   # nccl: pulled at the end
        transfer = None
        for ev in events:
            part = ev.WhichOneof("part")
            if part in ("kv", "state"):
                for dst, m in buffers.destinations(ev):
                    if self.links is None:
                        dst.copy_(from_proto(m))
                    else:
                        parts.append((dst, m))
            elif part == "transfer":
                transfer = ev.transfer
            elif part == "logits":
                if buffers.missing():
                    raise PrefillFailed(f"the prefill stream missed layers {buffers.missing()}")
                if self.links is not None:
                    if transfer is None or transfer.tensors != len(parts):
                        raise PrefillFailed("the prefill stream did not announce its transfer")
                    self._pull(conn, transfer.id, parts)
                return buffers.export(from_proto(ev.logits))
        raise PrefillFailed("the prefill stream ended before the logits")

    def _pull(self, conn: _Conn, transfer: int, parts) -> None:
        """nccl: ask the replica to send transfer `transfer`, then receive its tensors in
        order. One pull per link at a time, so concurrent prompts never interleave."""
        with conn.link_lock:
            conn.stub.Pull(pb.PullRequest(transfer=transfer, nccl_peer=self.peer,
                                          tensors=len(parts)))
            for dst, m in parts:
                dst.copy_(conn.link.recv(m))
