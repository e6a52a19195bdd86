"""`grpc` transport: tensor bytes in protobuf over one persistent bidirectional stream per
pool replica, so a decode step's per-layer calls do not each pay a new RPC. A replica on
this host gets the same frames over its same-host link instead (`local_link`)."""
from __future__ import annotations

import itertools
import queue
import socket
import threading

import grpc

from services.common import local_link
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.common.codec import (from_proto, generator_state, history_fields,
                                   processing_fields, reply_value, to_proto)
from services.common.grpc_security import INSECURE, GrpcSecurity
from services.common.transport import Pending, Transport

_OPTIONS = [("grpc.max_send_message_length", 512 << 20),
            ("grpc.max_receive_message_length", 512 << 20)]


class _Replies:
    """A replica answers a stream's calls in order; several may be in flight (`submit`), and
    a retried call can be sent on a stream that still owes earlier replies. `reply_to`
    reads until the reply to its own request id, keeping the others for their callers."""

    early: dict

    def reply_to(self, rid: int) -> pb.PoolReply:
        while rid not in self.early:
            reply = self.receive()
            self.early[reply.id] = reply
        return self.early.pop(rid)


class PoolStream(_Replies):
    """A client's stream to one replica at `address`; reopened after a failure.
    `security`: the token its calls carry, and TLS."""

    def __init__(self, address: str, security: GrpcSecurity = INSECURE):
        self.name = address
        self.channel = security.channel(address, options=_OPTIONS)
        self.stub = pb_grpc.MLPPoolStub(self.channel)
        self._open()

    def _open(self):
        self.requests: queue.Queue = queue.Queue()
        self.responses = self.stub.Calls(iter(self.requests.get, None))
        self.early = {}

    def send(self, req: pb.PoolRequest) -> None:
        self.requests.put(req)

    def receive(self) -> pb.PoolReply:
        try:
            return next(self.responses)
        except grpc.RpcError:
            self.requests.put(None)
            self._open()                    # the next call reconnects
            raise

    def roundtrip(self, req: pb.PoolRequest) -> pb.PoolReply:
        self.send(req)
        return self.reply_to(req.id)

    def close(self):
        self.requests.put(None)
        self.channel.close()


class LocalPoolStream(_Replies):
    """`PoolStream`'s calls to a replica on this host, over its same-host link: the
    request's protobuf bytes out, the reply's back, in order. A broken link reconnects on
    the next call, or raises there (the transport then retries elsewhere)."""

    def __init__(self, address: str, sock, token: str | None):
        self.name, self.sock, self.token = address, sock, token
        self.early = {}
        self.owed = 0               # requests sent whose replies are not read yet
        self._lock = threading.Lock()
        self._outbox: queue.Queue | None = None
        self._queued = 0            # frames handed to the sender thread, not yet written

    @classmethod
    def open(cls, address: str, security: GrpcSecurity) -> "LocalPoolStream | None":
        sock = local_link.connect(address, security.token)
        return cls(address, sock, security.token) if sock is not None else None

    def send(self, req: pb.PoolRequest) -> None:
        if self.sock is None:
            self.sock = local_link.connect(self.name, self.token)
            if self.sock is None:
                raise ConnectionError(f"pool replica {self.name}: same-host link gone")
        data = req.SerializeToString()
        with self._lock:
            # The replica reads a call only after it wrote the reply before it, so while a
            # reply is owed, writing here could block on a full socket while the replica
            # blocks writing that reply to us: the sender thread writes instead, and this
            # thread goes on to read. Nothing owed and nothing queued: written at once.
            behind = self.owed > 0 or self._queued > 0
            if behind:
                self._queued += 1
            self.owed += 1
        if behind:
            self._sender().put((self.sock, data))
            return
        try:
            local_link.send_frame(self.sock, data)
        except OSError:
            self._drop()
            raise

    def receive(self) -> pb.PoolReply:
        if self.sock is None:
            raise ConnectionError(f"pool replica {self.name}: same-host link gone")
        try:
            reply = pb.PoolReply.FromString(local_link.recv_frame(self.sock))
        except OSError:
            self._drop()
            raise
        with self._lock:
            self.owed -= 1
        return reply

    def _sender(self) -> queue.Queue:
        if self._outbox is None:
            self._outbox = queue.Queue()
            threading.Thread(target=self._send_queued, args=(self._outbox,), daemon=True,
                             name=f"link-send-{self.name}").start()
        return self._outbox

    def _send_queued(self, outbox: queue.Queue) -> None:
        while True:
            sock, data = outbox.get()
            if sock is None:
                return
            try:
                local_link.send_frame(sock, data)
            except OSError:          # the reader's next receive fails and retries elsewhere
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                self._queued -= 1

    def roundtrip(self, req: pb.PoolRequest) -> pb.PoolReply:
        self.send(req)
        return self.reply_to(req.id)

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.early = {}
        with self._lock:
            self.owed = 0

    def close(self):
        self._drop()
        if self._outbox is not None:
            self._outbox.put((None, None))


class GrpcTransport(Transport):
    """Replicas are `host:port` strings of `services.mlp_pool.grpc_server` servers."""

    pipelines = True     # a stream answers its calls in the order they were sent

    def __init__(self, replicas: list, security: GrpcSecurity = INSECURE):
        self.security = security
        super().__init__(replicas)
        self._ids = itertools.count()

    def _open(self, replica):
        if not isinstance(replica, str):
            return replica
        return (LocalPoolStream.open(replica, self.security)
                or PoolStream(replica, self.security))

    def _close(self, replica) -> None:
        replica.close()

    def _encode(self, method: str, args) -> pb.PoolRequest:
        rid = next(self._ids)
        if method == "stage":
            layer, u, positions = args
            return pb.PoolRequest(id=rid, stage=pb.StageCall(layer=layer, u=to_proto(u),
                                                             positions=to_proto(positions)))
        if method == "final":
            u, params, generators, histories = args
            return pb.PoolRequest(id=rid, final=pb.FinalCall(u=to_proto(u), params=[
                pb.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                  generator_state=generator_state(g),
                                  **processing_fields(p), **history_fields(p, h))
                for p, g, h in zip(params, generators, histories or [None] * len(params))]))
        if method == "score":
            u, targets, k = args
            return pb.PoolRequest(id=rid, score=pb.ScoreCall(u=to_proto(u),
                                                             targets=to_proto(targets), k=k))
        raise ValueError(f"unknown pool method {method!r}")

    def _decode(self, replica: PoolStream, reply: pb.PoolReply, args):
        return self._decode_tensors(replica, reply, [from_proto(t) for t in reply.tensors],
                                    args)

    def _decode_tensors(self, replica, reply: pb.PoolReply, tensors: list, args):
        if reply.error:
            raise RuntimeError(f"{replica.name}: {reply.error}")
        return reply_value(reply.kind, tensors, reply.generator_states,
                           args[2] if reply.kind == "final" else ())

    def _invoke(self, replica: PoolStream, method: str, *args):
        return self._decode(replica, replica.roundtrip(self._encode(method, args)), args)

    def submit(self, method: str, *args) -> Pending:
        """Send now, receive on `result()`; a failure there falls back to `call`, which
        retries on the other replicas."""
        replica = self.next_replica()
        req = self._encode(method, args)
        try:
            replica.send(req)
        except Exception:
            return Pending(lambda: self.call(method, *args))

        def fetch():
            try:
                return self._decode(replica, replica.reply_to(req.id), args)
            except Exception:
                self.set.retry()
                return self.call(method, *args)
        return Pending(fetch)
