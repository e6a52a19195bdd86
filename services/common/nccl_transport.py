"""`nccl` transport: control over the gRPC stream, tensors over cupy NCCL between GPUs.

Each (attention service, pool replica) pair shares a two-rank NCCL communicator: rank 0 is
the cache side, rank 1 the replica. A stage call is the `grpc` transport's control message
with every tensor sent as metadata only (dtype, shape, no bytes), followed by one NCCL
`send` per tensor on the current CUDA stream; the replica `recv`s them into fresh device
buffers in the same order, runs the stage, and answers the same way. Tensors travel as raw
bytes (`ncclUint8`), so every dtype goes through unchanged. NCCL ops are stream-ordered,
so neither side synchronizes the host: the next kernel on the stream waits for the bytes.

The prefill service uses the same links for a prompt's KV and states
(`services.prefill.server`, `Pull`).

Setup (Ray, `services.deployment.ray_cluster`): the replica makes a unique id and starts joining
as rank 1 on a thread (`NcclEndpoint.listen`); the cache side joins as rank 0 with that
id (`NcclTransport.connect`). cupy is imported lazily: without CUDA this module imports,
and only building a link fails, with a clear error.
"""
from __future__ import annotations

import threading

import torch

from services.common.grpc_security import INSECURE, GrpcSecurity
from services.common.grpc_transport import GrpcTransport, PoolStream
from services.common.pb import splitstack_pb2 as pb


def _nccl():
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as exc:  # pragma: no cover - depends on the optional GPU extra
        raise RuntimeError("the nccl transport needs cupy (pip install '.[gpu]')") from exc
    if not cupy.cuda.is_available():
        raise RuntimeError("the nccl transport needs a CUDA device")
    return nccl


def meta(t: torch.Tensor) -> pb.Tensor:
    """The proto `Tensor` of `t` without its bytes (they travel over NCCL)."""
    return pb.Tensor(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))


class NcclLink:
    """One side of a two-rank communicator: ordered tensor send / recv with the peer."""

    def __init__(self, unique_id, rank: int):
        nccl = _nccl()
        self.rank, self.peer = rank, 1 - rank
        self.comm = nccl.NcclCommunicator(2, unique_id, rank)
        self._uint8 = nccl.NCCL_UINT8

    @staticmethod
    def new_id():
        return _nccl().get_unique_id()

    def send(self, t: torch.Tensor) -> None:
        t = t.contiguous()
        if not t.is_cuda:
            t = t.cuda(non_blocking=True)
        stream = torch.cuda.current_stream().cuda_stream
        self.comm.send(t.data_ptr(), t.numel() * t.element_size(), self._uint8, self.peer,
                       stream)
        self._hold = t        # keep the buffer alive until the stream has used it

    def recv(self, m: pb.Tensor) -> torch.Tensor:
        out = torch.empty(tuple(m.shape), dtype=getattr(torch, m.dtype), device="cuda")
        stream = torch.cuda.current_stream().cuda_stream
        self.comm.recv(out.data_ptr(), out.numel() * out.element_size(), self._uint8,
                       self.peer, stream)
        return out


class NcclEndpoint:
    """Server side (a pool or prefill replica): one link per cache-side peer, made on
    request (`listen`)."""

    def __init__(self):
        self.links: dict[str, NcclLink] = {}
        self._joining: dict[str, threading.Thread] = {}

    def listen(self, peer: str):
        """A fresh unique id for `peer`; joins as rank 1 in the background (the
        communicator's constructor blocks until the peer joins as rank 0)."""
        uid = NcclLink.new_id()

        def join():
            self.links[peer] = NcclLink(uid, rank=1)
        thread = threading.Thread(target=join, name=f"nccl-{peer}", daemon=True)
        thread.start()
        self._joining[peer] = thread
        return uid

    def link(self, peer: str) -> NcclLink:
        thread = self._joining.pop(peer, None)
        if thread is not None:
            thread.join()
        if peer not in self.links:
            raise RuntimeError(f"no NCCL link with {peer!r}")
        return self.links[peer]


class NcclPoolStream(PoolStream):
    """The gRPC control stream to one replica plus the NCCL link to it."""

    def __init__(self, address: str, link: NcclLink, peer_name: str,
                 security: GrpcSecurity = INSECURE):
        super().__init__(address, security)
        self.link, self.peer_name = link, peer_name


class NcclTransport(GrpcTransport):
    pipelines = False    # one NCCL message in flight per replica: a send waits for its receive

    @classmethod
    def connect(cls, name: str, pool_actors: list, addresses: list[str],
                security: GrpcSecurity = INSECURE) -> "NcclTransport":
        """Join one communicator per pool replica actor (as rank 0) and open its stream."""
        import ray

        streams = []
        for actor, address in zip(pool_actors, addresses):
            uid = ray.get(actor.nccl_listen.remote(name))
            streams.append(NcclPoolStream(address, NcclLink(uid, rank=0), name, security))
        return cls(streams)

    def _open(self, replica):
        if isinstance(replica, str):
            raise NotImplementedError(f"nccl: pool replica {replica} needs a link made by the "
                                      "deployment; replicas join only at startup")
        return replica

    def _send(self, replica: NcclPoolStream, method: str, args) -> None:
        if method == "stage":
            layer, u, positions = args
            sent = [u, positions]
            req = pb.PoolRequest(id=next(self._ids), nccl_peer=replica.peer_name,
                                 stage=pb.StageCall(layer=layer, u=meta(u),
                                                    positions=meta(positions)))
        elif method == "final":
            u = args[0]
            sent = [u]
            req = super()._encode(method, args)
            req.nccl_peer = replica.peer_name
            req.final.u.CopyFrom(meta(u))
        elif method == "score":
            u, targets, _ = args
            sent = [u, targets]
            req = super()._encode(method, args)
            req.nccl_peer = replica.peer_name
            req.score.u.CopyFrom(meta(u))
            req.score.targets.CopyFrom(meta(targets))
        else:
            raise ValueError(f"unknown pool method {method!r}")
        replica.send(req)
        for t in sent:
            replica.link.send(t)

    def _receive(self, replica: NcclPoolStream, args):
        reply = replica.receive()
        if not reply.error:       # the tensors follow over NCCL, in order
            data = [replica.link.recv(m) for m in reply.tensors]
            reply.ClearField("tensors")
            return self._decode_tensors(replica, reply, data, args)
        return self._decode_tensors(replica, reply, [], args)

    def _invoke(self, replica: NcclPoolStream, method: str, *args):
        self._send(replica, method, args)
        return self._receive(replica, args)

    def submit(self, method: str, *args):
        from services.common.transport import Pending

        replica = self.next_replica()
        try:
            self._send(replica, method, args)
        except Exception:
            return Pending(lambda: self.call(method, *args))

        def fetch():
            try:
                return self._receive(replica, args)
            except Exception:
                self.set.retry()
                return self.call(method, *args)
        return Pending(fetch)
