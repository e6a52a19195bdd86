"""The `nccl` transport's protocol on the CPU: everything but the cupy communicator.

`test_nccl_transport.py` runs the real thing and needs two CUDA devices. Here the two-rank
communicator is replaced by an in-process loopback with the same ordered `send` / `recv`
(`LoopbackLink`), so the rest of the path runs for real on any machine: the metadata-only
control messages over the real gRPC stream, the pool server receiving each tensor from the
link in order, the reply's tensors coming back the same way, the `final` stage with its
seeded generators, and the retry of a dead replica. The prefill service's KV and states go
over such a link too (its `Pull`), checked here the same way.
"""
from __future__ import annotations

import queue
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from models import load_model
from services.attention.runner import qfirst_engine
from services.common.nccl_transport import NcclPoolStream, NcclTransport
from services.engine import GenerationParams, LLMEngine
from services.mlp_pool import MLPPool
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.deployment.build import EngineOptions, build_engine
from services.mlp_pool.grpc_server import serve_pool
from services.prefill.client import PrefillClient, PrefillFailed
from services.prefill.server import PendingTransfers, serve_prefill
from tests.helpers.pools import PARAMS, generate_stopping_after_prefill, prompts
from tests.helpers.prefill import PARAMS as PREFILL_PARAMS
from tests.helpers.prefill import attention as prefill_attention
from tests.helpers.prefill import no_leaks as no_prefill_leaks
from tests.helpers.prefill import prompts as prefill_prompts


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
    """Stands in for `NcclEndpoint`: the replica's links by peer name."""

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
    return qfirst_engine(model, NcclTransport(streams), num_shards=num_shards, block_size=4,
                         num_blocks=64)


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


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_nccl_protocol_matches_exact_engine(family, tiny_checkpoint, nccl_pools):
    path, _ = tiny_checkpoint(family)
    model = load_model(path)
    ref = LLMEngine(model).generate(prompts(), PARAMS)
    streams = [st for _, st in nccl_pools(model, 2)]
    service = service_over(model, streams)
    got = service.generate(prompts(), PARAMS)
    for r, s in zip(got, ref):
        assert r.output_ids == s.output_ids
        assert (torch.stack(r.logits) - torch.stack(s.logits)).abs().max().item() <= 1e-4
    service.blocks.check()
    assert service.blocks.num_free == service.blocks.num_blocks
    for st in streams:
        assert st.control_out and st.control_in
        # control only on gRPC: every tensor travelled over the link, none as bytes
        assert sum(tensor_bytes(r) for r in st.control_out + st.control_in) == 0
        assert {r.nccl_peer for r in st.control_out} == {"attention-0"}
        # a stage call sends u and positions, the final stage u
        assert st.link.sent == sum(2 if r.HasField("stage") else 1 for r in st.control_out)
        assert st.link.received == sum(len(r.tensors) for r in st.control_in) > 0


@pytest.mark.slow
def test_nccl_protocol_seeded_sampling(tiny_checkpoint, nccl_pools):
    """The `final` stage carries the generators' states on gRPC and the logits over the
    link: seeded sampling gives the exact engine's tokens."""
    from kernels.sampling import SamplingParams

    path, _ = tiny_checkpoint("llama3")
    model = load_model(path)
    params = GenerationParams(max_tokens=8, ignore_eos=True,
                              sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=4))
    ref = [r.output_ids for r in LLMEngine(model).generate(prompts(), params)]
    service = service_over(model, [st for _, st in nccl_pools(model, 1)], num_shards=1)
    assert [r.output_ids for r in service.generate(prompts(), params)] == ref


@pytest.mark.slow
def test_nccl_protocol_dead_replica_is_retried(tiny_checkpoint, nccl_pools):
    path, _ = tiny_checkpoint("qwen3_next")
    model = load_model(path)
    ref = [r.output_ids for r in LLMEngine(model).generate(prompts(), PARAMS)]
    pairs = nccl_pools(model, 2)
    service = service_over(model, [st for _, st in pairs])
    got = generate_stopping_after_prefill(service, lambda: pairs[0][0].stop(0))
    assert got == ref and service.runner.pool.retries > 0


# ---- the prefill service's KV and states over the link --------------------------------
class RecordingPrefillClient(PrefillClient):
    """Keeps every event of the prefill streams, to check what crossed gRPC."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events = []

    def _receive(self, call, n, conn, acked=None):
        events = list(call)
        self.events += events
        return super()._receive(iter(events), n, conn, acked)


@pytest.fixture
def nccl_prefill():
    """start(model, path, nccl=True) -> (address, engine, the caller's link end): a prefill
    replica on loopback whose link to "attention-0" is a loopback pair."""
    started = []

    def start(model, path, nccl=True):
        cache_end, replica_end = link_pair()
        registry = CollectorRegistry()
        engine, service = build_engine(model, path, EngineOptions(kv_cache_bytes=8 << 20),
                                       registry)
        server, address, loop = serve_prefill(
            engine, registry, nccl=Endpoint({"attention-0": replica_end}) if nccl
            else None)
        started.append((server, loop))
        return address, engine, cache_end, replica_end, registry

    yield start
    for server, loop in started:
        server.stop(0)
        loop.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "qwen3_next"])
def test_nccl_prefill_matches_exact_engine(family, tiny_checkpoint, nccl_prefill):
    """Four prompts prefilled concurrently by one replica, their KV and GDN states pulled
    over one link (one pull at a time, in the order the metadata came), then decoded by the
    attention service: the exact engine's tokens and logits, and no tensor bytes on gRPC
    except each prompt's logits."""
    path, _ = tiny_checkpoint(family)
    model = load_model(path)
    cfg = model.config
    batch = prefill_prompts(lengths=(7, 30, 12, 19, 25, 9))
    ref = LLMEngine(model).generate(batch, PREFILL_PARAMS)
    address, engine, cache_end, replica_end, _ = nccl_prefill(model, path)
    client = RecordingPrefillClient([address], cfg, model.dtype, links=[cache_end],
                                    peer="attention-0")
    with ThreadPoolExecutor(len(batch)) as ex:
        exports = list(ex.map(lambda p: client.prefill(p, pb.PrefillOptions()), batch))
    service = prefill_attention(model)
    ids = [service.add_request(p, PREFILL_PARAMS, prefilled=e) for p, e in zip(batch, exports)]
    while service.has_unfinished():
        service.step()
    for i, s in zip(ids, ref):
        r = service.pop(i)
        assert r.output_ids == s.output_ids
        assert (torch.stack(r.logits) - torch.stack(s.logits)).abs().max().item() <= 1e-4
    per_prompt = 2 * len(cfg.full_attention_layers) + 2 * len(cfg.linear_attention_layers)
    assert replica_end.sent == cache_end.received == len(batch) * per_prompt
    kinds = [ev.WhichOneof("part") for ev in client.events]
    assert kinds.count("transfer") == kinds.count("logits") == len(batch)
    for ev in client.events:
        if ev.WhichOneof("part") in ("kv", "state"):
            assert tensor_bytes(ev) == 0          # metadata only; the bytes took the link
        elif ev.WhichOneof("part") == "logits":
            assert len(ev.logits.data) == cfg.vocab_size * model.dtype.itemsize
    no_prefill_leaks(engine, service)


@pytest.mark.slow
def test_nccl_prefill_pull_is_checked(tiny_checkpoint, nccl_prefill):
    """A pull for another count or another peer sends nothing and drops the transfer; a
    transfer is pulled once; a replica without links refuses an nccl prefill."""
    path, _ = tiny_checkpoint("qwen3_next")
    model = load_model(path)
    address, engine, cache_end, replica_end, _ = nccl_prefill(model, path)
    stub = pb_grpc.PrefillStub(grpc.insecure_channel(address))
    req = pb.PrefillRequest(prompt_ids=prefill_prompts()[0], nccl_peer="attention-0")
    transfers = [ev.transfer for ev in stub.Prefill(req) if ev.WhichOneof("part") == "transfer"]
    assert len(transfers) == 1 and transfers[0].tensors > 0
    t = transfers[0]
    for pull in (pb.PullRequest(transfer=t.id, nccl_peer="attention-0", tensors=t.tensors + 1),
                 pb.PullRequest(transfer=t.id, nccl_peer="attention-0", tensors=t.tensors)):
        with pytest.raises(grpc.RpcError) as err:
            stub.Pull(pull)
        assert err.value.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                    grpc.StatusCode.NOT_FOUND)
    assert replica_end.sent == 0
    # the full round trip on a fresh prompt, then a second pull of it finds nothing
    t = [ev.transfer for ev in stub.Prefill(req) if ev.WhichOneof("part") == "transfer"][0]
    ok = pb.PullRequest(transfer=t.id, nccl_peer="attention-0", tensors=t.tensors)
    assert stub.Pull(ok).tensors == t.tensors == replica_end.sent
    with pytest.raises(grpc.RpcError) as err:
        stub.Pull(ok)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    no_prefill_leaks(engine)

    plain, _, _, _, _ = nccl_prefill(model, path, nccl=False)
    client = PrefillClient([plain], model.config, model.dtype, links=[cache_end],
                           peer="attention-0")
    with pytest.raises(PrefillFailed, match="no NCCL links"):
        client.prefill(prefill_prompts()[0], pb.PrefillOptions())


def test_pending_transfers_expire():
    from prometheus_client import Counter

    expired = Counter("expired_total", "", registry=CollectorRegistry())
    table = PendingTransfers(ttl_s=0.0, expired=expired)
    first = table.put("attention-0", [torch.zeros(2)])
    time.sleep(0.01)
    second = table.put("attention-0", [torch.ones(2)])   # drops the first, now too old
    assert table.pop(first) is None and len(table) == 1
    peer, tensors = table.pop(second)
    assert peer == "attention-0" and torch.equal(tensors[0], torch.ones(2))
    assert expired._value.get() == 1 and len(table) == 0
