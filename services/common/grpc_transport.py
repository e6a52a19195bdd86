"""`grpc` transport: tensor bytes in protobuf over one persistent bidirectional stream per
pool replica, so a decode step's per-layer calls do not each pay a new RPC."""
from __future__ import annotations

import itertools
import queue

import grpc
import torch

from models.gdn import GDNInputs
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.common.tensor_codec import from_proto, to_proto
from services.common.transport import TRANSPORTS, Transport
from services.mlp_pool.pool import StageOutput

_OPTIONS = [("grpc.max_send_message_length", 512 << 20),
            ("grpc.max_receive_message_length", 512 << 20)]


class PoolStream:
    """A client's stream to one replica at `address`; reopened after a failure."""

    def __init__(self, address: str):
        self.name = address
        self.channel = grpc.insecure_channel(address, options=_OPTIONS)
        self.stub = pb_grpc.MLPPoolStub(self.channel)
        self._open()

    def _open(self):
        self.requests: queue.Queue = queue.Queue()
        self.responses = self.stub.Calls(iter(self.requests.get, None))

    def roundtrip(self, req: pb.PoolRequest, timeout: float = 120.0) -> pb.PoolReply:
        try:
            self.requests.put(req)
            return next(self.responses)
        except grpc.RpcError:
            self.requests.put(None)
            self._open()                    # the next call reconnects
            raise

    def close(self):
        self.requests.put(None)
        self.channel.close()


class GrpcTransport(Transport):
    """Replicas are `host:port` strings of `services.mlp_pool.grpc_server` servers."""

    def __init__(self, replicas: list):
        super().__init__([PoolStream(r) if isinstance(r, str) else r for r in replicas])
        self._ids = itertools.count()

    def _invoke(self, replica: PoolStream, method: str, *args):
        rid = next(self._ids)
        if method == "stage":
            layer, u, positions = args
            req = pb.PoolRequest(id=rid, stage=pb.StageCall(layer=layer, u=to_proto(u),
                                                            positions=to_proto(positions)))
        elif method == "final":
            u, params, generators = args
            req = pb.PoolRequest(id=rid, final=pb.FinalCall(u=to_proto(u), params=[
                pb.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                  generator_state=(g.get_state().numpy().tobytes()
                                                   if g is not None else b""))
                for p, g in zip(params, generators)]))
        else:
            raise ValueError(f"unknown pool method {method!r}")
        reply = replica.roundtrip(req)
        if reply.error:
            raise RuntimeError(f"{replica.name}: {reply.error}")
        tensors = [from_proto(t) for t in reply.tensors]
        if reply.kind == "attn":
            return StageOutput(tensors[0], tensors[1], tensors[2])
        if reply.kind == "gdn":
            return StageOutput(tensors[0], gdn=GDNInputs(*tensors[1:]))
        for g, state in zip(generators, reply.generator_states):
            if g is not None:                # advance the request's own generator
                g.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        return tuple(tensors)


TRANSPORTS["grpc"] = GrpcTransport
