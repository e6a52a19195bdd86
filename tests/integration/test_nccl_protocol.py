"""The `nccl` transport's protocol on the CPU: everything but the cupy communicator.

`test_nccl_transport.py` runs the real thing and needs two CUDA devices. Here the two-rank
communicator is replaced by an in-process loopback with the same ordered `send` / `recv`
(`LoopbackLink`), so the rest of the path runs for real on any machine: the metadata-only
control messages over the real gRPC stream, the pool server receiving each tensor from the
link in order, the reply's tensors coming back the same way, the `final` stage with its
seeded generators, and the retry of a dead replica.
"""
from __future__ import annotations

import queue

import pytest
import torch

from models import load_model
from services.attention.service import AttentionService
from services.attention.shard import KVShard
from services.common.nccl_transport import NcclPoolStream, NcclTransport
from services.engine import GenerationParams, LLMEngine
from services.mlp_pool import MLPPool
from services.mlp_pool.grpc_server import serve_pool
from tests.integration.test_qfirst_grpc import (PARAMS, generate_stopping_after_prefill,
                                                prompts)


class LoopbackLink:
    """One end of an ordered in-process tensor pipe with `NcclLink`'s interface."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue):
        self.inbox, self.outbox = inbox, outbox
        self.sent = self.received = 0

    def send(self, t: torch.Tensor) -> None:
        self.outbox.put(t.detach().contiguous().clone())
        self.sent += 1

    def recv(self, m) -> torch.Tensor:
        t = self.inbox.get(timeout=30)
        # the metadata on the control stream must describe the bytes on the link
        assert list(t.shape) == list(m.shape), (list(t.shape), list(m.shape))
        assert str(t.dtype).removeprefix("torch.") == m.dtype
        self.received += 1
        return t


def link_pair() -> tuple[LoopbackLink, LoopbackLink]:
    a, b = queue.Queue(), queue.Queue()
    return LoopbackLink(a, b), LoopbackLink(b, a)


class Endpoint:
    """Stands in for `PoolNcclEndpoint`: the replica's links by peer name."""

    def __init__(self, links: dict[str, LoopbackLink]):
        self.links = links

    def link(self, peer: str) -> LoopbackLink:
        return self.links[peer]


class RecordingStream(NcclPoolStream):
    """Keeps what crossed the gRPC stream, to check that no tensor bytes did."""

    def __init__(self, address, link, peer):
        super().__init__(address, link, peer)
        self.control_out, self.control_in = [], []

    def send(self, req):
        self.control_out.append(req)
        super().send(req)

    def receive(self):
        reply = super().receive()
        self.control_in.append(type(reply).FromString(reply.SerializeToString()))  # a copy
        return reply


@pytest.fixture
def nccl_pools():
    """start(model, n) -> n (server, stream) pairs: pool replicas behind real gRPC servers,
    each joined to the cache side by a loopback link."""
    started = []

    def start(model, n, peer="attention-0"):
        pairs = []
        for i in range(n):
            cache_end, pool_end = link_pair()
            server, address = serve_pool(MLPPool(model, f"pool-{i}"),
                                         nccl=Endpoint({peer: pool_end}))
            started.append(server)
            pairs.append((server, RecordingStream(address, cache_end, peer)))
        return pairs

    yield start
    for server in started:
        server.stop(0)


def service_over(model, streams, num_shards=2):
    shards = [KVShard(model.config, i, num_shards, 64, 4, model.dtype)
              for i in range(num_shards)]
    return AttentionService(model, shards, NcclTransport(streams)), shards


def tensor_bytes(msg) -> int:
    """Bytes of tensor data anywhere in a proto message."""
    total = 0
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        items = [value] if hasattr(value, "ListFields") else list(value)
        for item in items:
            total += len(item.data) if field.message_type.name == "Tensor" else tensor_bytes(item)
    return total


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_nccl_protocol_matches_exact_engine(family, tiny_checkpoint, nccl_pools):
    path, _ = tiny_checkpoint(family)
    model = load_model(path)
    ref = LLMEngine(model).generate(prompts(), PARAMS)
    streams = [st for _, st in nccl_pools(model, 2)]
    service, shards = service_over(model, streams)
    got = service.generate(prompts(), PARAMS)
    for r, s in zip(got, ref):
        assert r.output_ids == s.output_ids
        assert (torch.stack(r.logits) - torch.stack(s.logits)).abs().max().item() <= 1e-4
    assert all(s.blocks.num_free == s.blocks.num_blocks for s in shards)
    for st in streams:
        assert st.control_out and st.control_in
        # control only on gRPC: every tensor travelled over the link, none as bytes
        assert sum(tensor_bytes(r) for r in st.control_out + st.control_in) == 0
        assert {r.nccl_peer for r in st.control_out} == {"attention-0"}
        # a stage call sends u and positions, the final stage u
        assert st.link.sent == sum(2 if r.HasField("stage") else 1 for r in st.control_out)
        assert st.link.received == sum(len(r.tensors) for r in st.control_in) > 0


def test_nccl_protocol_seeded_sampling(tiny_checkpoint, nccl_pools):
    """The `final` stage carries the generators' states on gRPC and the logits over the
    link: seeded sampling gives the exact engine's tokens."""
    from kernels.sampling import SamplingParams

    path, _ = tiny_checkpoint("llama3")
    model = load_model(path)
    params = GenerationParams(max_tokens=8, ignore_eos=True,
                              sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=4))
    ref = [r.output_ids for r in LLMEngine(model).generate(prompts(), params)]
    service, _ = service_over(model, [st for _, st in nccl_pools(model, 1)], num_shards=1)
    assert [r.output_ids for r in service.generate(prompts(), params)] == ref


def test_nccl_protocol_dead_replica_is_retried(tiny_checkpoint, nccl_pools):
    path, _ = tiny_checkpoint("qwen3_next")
    model = load_model(path)
    ref = [r.output_ids for r in LLMEngine(model).generate(prompts(), PARAMS)]
    pairs = nccl_pools(model, 2)
    service, _ = service_over(model, [st for _, st in pairs])
    got = generate_stopping_after_prefill(service, lambda: pairs[0][0].stop(0))
    assert got == ref and service.pool.retries > 0
