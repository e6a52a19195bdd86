"""Serves an `MLPPool` over gRPC: one bidirectional stream per client, calls in order."""
from __future__ import annotations

from concurrent import futures

import grpc
import torch

from kernels.sampling import SamplingParams
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.common.tensor_codec import from_proto, to_proto
from services.mlp_pool.pool import MLPPool


def _generator(state: bytes) -> torch.Generator | None:
    if not state:
        return None
    gen = torch.Generator()
    gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return gen


class PoolServicer(pb_grpc.MLPPoolServicer):
    def __init__(self, pool: MLPPool):
        self.pool = pool

    def _run(self, req: pb.PoolRequest) -> pb.PoolReply:
        if req.HasField("stage"):
            out = self.pool.stage(req.stage.layer, from_proto(req.stage.u),
                                  from_proto(req.stage.positions))
            if out.gdn is None:
                return pb.PoolReply(id=req.id, kind="attn",
                                    tensors=[to_proto(t) for t in (out.z, out.k, out.v)])
            return pb.PoolReply(id=req.id, kind="gdn",
                                tensors=[to_proto(t) for t in (out.z, *out.gdn)])
        params = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
                  for p in req.final.params]
        gens = [_generator(p.generator_state) for p in req.final.params]
        tokens, logprobs, logits = self.pool.final(from_proto(req.final.u), params, gens)
        states = [g.get_state().numpy().tobytes() if g is not None else b"" for g in gens]
        return pb.PoolReply(id=req.id, kind="final",
                            tensors=[to_proto(t) for t in (tokens, logprobs, logits)],
                            generator_states=states)

    def Calls(self, request_iterator, context):
        for req in request_iterator:
            try:
                yield self._run(req)
            except Exception as exc:  # the caller retries elsewhere; the stream stays up
                yield pb.PoolReply(id=req.id, error=f"{type(exc).__name__}: {exc}")

    def Health(self, request, context):
        return pb.Empty()


def serve_pool(pool: MLPPool, address: str = "127.0.0.1:0", max_workers: int = 4):
    """Start a gRPC server for `pool`; returns (server, bound address)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         options=[("grpc.max_send_message_length", 512 << 20),
                                  ("grpc.max_receive_message_length", 512 << 20)])
    pb_grpc.add_MLPPoolServicer_to_server(PoolServicer(pool), server)
    port = server.add_insecure_port(address)
    server.start()
    return server, f"{address.rsplit(':', 1)[0]}:{port}"
