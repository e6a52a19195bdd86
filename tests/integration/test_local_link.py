"""The pool replica's same-host link (`services.common.local_link`): a `grpc` transport to a
replica on this host takes it, gives the gRPC stream's answers and the exact engine's
tokens; it is refused a wrong token or another replica's address; it ends with the
server, and the calls then go to the next replica; its clients count as the replica's."""
from __future__ import annotations

import json
import socket

import pytest
import torch

from kernels.sampling import SamplingParams
from models import load_model
from services.attention.runner import qfirst_engine
from services.common import local_link
from services.common.grpc_security import GrpcSecurity
from services.common.grpc_transport import LocalPoolStream, PoolStream
from services.common.pb import splitstack_pb2 as pb
from services.deployment.transports import make_transport
from services.engine import LLMEngine
from services.mlp_pool import MLPPool
from services.mlp_pool.grpc_server import serve_pool
from tests.helpers.pools import PARAMS, prompts

pytestmark = pytest.mark.slow


@pytest.fixture
def servers():
    started = []

    def start(model, n, **kw):
        for i in range(n):
            started.append(serve_pool(MLPPool(model, f"pool-{i}"), **kw))
        return [address for _, address in started]

    start.started = started
    yield start
    for server, _ in started:
        server.stop(0)


@pytest.fixture
def model(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_next")
    return load_model(path)


def stage_call(transport, model):
    torch.manual_seed(0)
    u = torch.randn(3, model.config.hidden_size)
    return transport.call("stage", 1, u, torch.tensor([4, 9, 2]))


def test_a_replica_on_this_host_is_reached_over_the_link_with_the_streams_answers(
        model, servers, monkeypatch):
    (address,) = servers(model, 1)
    linked = make_transport("grpc", [address])
    monkeypatch.setenv("SPLITSTACK_LOCAL_LINK", "0")
    streamed = make_transport("grpc", [address])
    assert type(linked.replicas[0]) is LocalPoolStream
    assert type(streamed.replicas[0]) is PoolStream
    a, b = stage_call(linked, model), stage_call(streamed, model)
    assert a.z.shape[0] == 3
    assert torch.equal(a.z, b.z)
    for x, y in zip((a.k, a.v), (b.k, b.v)):          # None for a linear-attention layer
        assert (x is None and y is None) or torch.equal(x, y)
    u = torch.randn(2, model.config.hidden_size)
    final = [t.call("final", u, [SamplingParams()] * 2, [None] * 2, None)
             for t in (linked, streamed)]
    assert torch.equal(final[0][0], final[1][0])


@pytest.mark.parametrize("link", ["1", "0"])
def test_the_engine_over_either_path_gives_the_exact_tokens(model, servers, monkeypatch, link):
    monkeypatch.setenv("SPLITSTACK_LOCAL_LINK", link)
    ref = [r.output_ids for r in LLMEngine(model).generate(prompts(), PARAMS)]
    transport = make_transport("grpc", servers(model, 1))
    assert type(transport.replicas[0]) is (LocalPoolStream if link == "1" else PoolStream)
    engine = qfirst_engine(model, transport, num_shards=2, block_size=4, num_blocks=64)
    assert [r.output_ids for r in engine.generate(prompts(), PARAMS)] == ref
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_wrong_token_is_refused_the_link_and_then_by_grpc(model, servers):
    (address,) = servers(model, 1, security=GrpcSecurity(token="right-token"))
    assert local_link.connect(address, "wrong-token") is None
    assert local_link.connect(address, None) is None
    assert local_link.connect(address, "right-token") is not None
    wrong = make_transport("grpc", [address], GrpcSecurity(token="wrong-token"))
    assert type(wrong.replicas[0]) is PoolStream
    with pytest.raises(Exception, match="every MLP pool replica failed"):
        stage_call(wrong, model)
    right = make_transport("grpc", [address], GrpcSecurity(token="right-token"))
    assert type(right.replicas[0]) is LocalPoolStream
    assert stage_call(right, model).z.shape[0] == 3


def test_a_hello_for_another_replica_is_refused(model, servers):
    (address,) = servers(model, 1)
    port = int(address.rsplit(":", 1)[1])
    for dialled in (f"10.255.0.1:{port}", f"127.0.0.1:{port + 1}", "nonsense"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(local_link.socket_name(port))
            local_link.send_frame(s, json.dumps({"token": None, "address": dialled}).encode())
            assert local_link.recv_frame(s) != local_link.OK
    assert not local_link.is_local_ip("10.255.0.1")     # not this host: not even tried
    assert local_link.connect(f"10.255.0.1:{port}") is None


def test_the_link_ends_with_its_server_and_calls_go_to_the_next_replica(model, servers):
    addresses = servers(model, 2)
    transport = make_transport("grpc", addresses)
    assert all(type(r) is LocalPoolStream for r in transport.replicas)
    want = stage_call(transport, model).z
    first = transport.next_replica().name
    dict((a, s) for s, a in servers.started)[first].stop(0)
    assert local_link.connect(first) is None              # its listener went with it
    for _ in range(3):                                   # each call answered by the live one
        assert torch.equal(stage_call(transport, model).z, want)
    assert transport.retries >= 1


def test_link_clients_count_as_the_replicas_clients(model, servers):
    import time

    import grpc

    from services.common.pb import splitstack_pb2_grpc as pb_grpc

    (address,) = servers(model, 1)
    stats = pb_grpc.MLPPoolStub(grpc.insecure_channel(address)).Stats
    assert stats(pb.Empty()).clients == 0
    transport = make_transport("grpc", [address])
    stage_call(transport, model)
    assert stats(pb.Empty()).clients == 1                # what a drain waits on
    transport.replicas[0].close()
    deadline = time.monotonic() + 10
    while stats(pb.Empty()).clients and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats(pb.Empty()).clients == 0


def test_calls_in_flight_with_large_replies_do_not_deadlock(model, servers):
    """Two stage calls in flight whose tensors are larger than the socket's buffers (a step
    split in two parts with long prompts): the replica writes the first reply before it
    reads the second call, so the second is written by the stream's sender thread while
    the caller reads; both replies come back, each to its own call, equal to the gRPC
    stream's."""
    import threading

    (address,) = servers(model, 1)
    linked = make_transport("grpc", [address])
    assert isinstance(linked.replicas[0], LocalPoolStream)
    rows, h = 8192, model.config.hidden_size          # ~8 MB each way in fp32
    us = [torch.randn(rows, h, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    pos = torch.arange(rows) % 64
    layer = next(l for l in model.config.full_attention_layers if l > 0)   # k, v come back
    got = []

    def pipelined():
        first = linked.submit("stage", layer, us[0], pos)
        second = linked.submit("stage", layer, us[1], pos)
        got.append(first.result())
        third = linked.submit("stage", layer, us[2], pos)
        got.extend([second.result(), third.result()])

    worker = threading.Thread(target=pipelined, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the pipelined calls deadlocked"
    want = [MLPPool(model).stage(layer, u, pos) for u in us]
    for g, w in zip(got, want):
        assert torch.equal(g.z, w.z) and torch.equal(g.k, w.k) and torch.equal(g.v, w.v)
    assert linked.replicas[0].owed == 0
