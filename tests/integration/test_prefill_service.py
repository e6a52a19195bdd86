"""The prefill service behind real gRPC servers on loopback, feeding the attention service.

The attention service decodes prompts prefilled by a prefill replica (a whole-model engine
with `export_prompt`): exact prefill must give the exact engine's tokens and logits for every
family; the prefix cache and RidgeFill run there; a dead replica is retried on another; a
cancelled prefill frees its blocks; nothing leaks.
"""
from __future__ import annotations

import threading

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from kernels.sampling import SamplingParams
from models import load_model
from services.attention.server import serve_attention
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.engine import GenerationParams, LLMEngine
from services.deployment.build import EngineOptions, build_engine
from services.common.codec import options_to_proto
from services.common.messages import PrefillRequest
from services.prefill.client import (CancelHandle, PrefillCancelled, PrefillClient,
                                     PrefillFailed, PrefillRefused)
from services.prefill.server import serve_prefill
from tests.helpers.checkpoints import FAMILIES
from tests.helpers.prefill import PARAMS, attention, no_leaks, prompts

pytestmark = pytest.mark.slow


@pytest.fixture
def servers():
    """start(model, path, options) -> a prefill replica on loopback:
    (address, engine, registry, server)."""
    started = []

    def start(model, path, options=EngineOptions(kv_cache_bytes=8 << 20), name="prefill-0"):
        registry = CollectorRegistry()
        engine, service = build_engine(model, path, options, registry)
        server, address, loop = serve_prefill(engine, registry, name=name)
        started.append((server, loop))
        return address, engine, registry, server

    yield start
    for server, loop in started:
        server.stop(0)
        loop.shutdown()


def decode_prefilled(service, client, batch, params=PARAMS, options=pb.PrefillOptions()):
    ids = [service.add_request(p, params, prefilled=client.prefill(p, options)) for p in batch]
    while service.has_unfinished():
        service.step()
    return [service.pop(i) for i in ids]


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_prefill_service_matches_engine(family, tiny_checkpoint, servers):
    path, _ = tiny_checkpoint(family)
    model = load_model(path)
    ref = LLMEngine(model).generate(prompts(), PARAMS)
    address, engine, _, _ = servers(model, path)
    service = attention(model)
    client = PrefillClient([address], model.config, model.dtype)
    got = decode_prefilled(service, client, prompts())
    for r, s in zip(got, ref):
        assert r.output_ids == s.output_ids
        assert (torch.stack(r.logits) - torch.stack(s.logits)).abs().max().item() <= 1e-4
    no_leaks(engine, service)


def test_seeded_sampling_continues_after_remote_prefill(tiny_checkpoint, servers):
    """The first token is sampled on the attention service with the request's own seeded
    generator: the same stream as the engine's."""
    path, _ = tiny_checkpoint("llama3")
    model = load_model(path)
    params = GenerationParams(max_tokens=8, ignore_eos=True,
                              sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=11))
    ref = LLMEngine(model).generate(prompts(), params)
    address, *_ = servers(model, path)
    service = attention(model)
    got = decode_prefilled(service, PrefillClient([address], model.config, model.dtype),
                           prompts(), params)
    assert [r.output_ids for r in got] == [s.output_ids for s in ref]


def test_prefix_cache_hit_in_prefill_service(tiny_checkpoint, servers):
    """Dense: a hit at a non-block boundary reuses the KV exactly (same tokens, logits to
    fp32 rounding), and the replica's metrics count it."""
    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path)
    base = prompts((45,))[0]
    second = base[:37] + prompts((9,), seed=5)[0]        # shares 37 tokens: not 16-aligned
    ref = LLMEngine(model).generate([base, second], PARAMS)
    address, engine, registry, _ = servers(model, path, EngineOptions(
        kv_cache_bytes=8 << 20, prefix_cache_bytes=64 << 20))
    service = attention(model)
    client = PrefillClient([address], model.config, model.dtype)
    got = decode_prefilled(service, client, [base]) + decode_prefilled(service, client, [second])
    for r, s in zip(got, ref):
        assert r.output_ids == s.output_ids
        assert (torch.stack(r.logits) - torch.stack(s.logits)).abs().max().item() <= 1e-4
    hits = sum(m.value for fam in registry.collect() for m in fam.samples
               if m.name == "splitstack_prefix_cache_hit_tokens_total")
    assert hits == 37
    no_leaks(engine, service)


def test_hybrid_prefix_hit_replays_in_prefill_service(tiny_checkpoint, servers):
    """Hybrid with r = 1: the replay covers the whole hit, so the states are exact again."""
    path, _ = tiny_checkpoint("qwen3_5")
    model = load_model(path)
    base = prompts((40,))[0]
    second = base[:33] + prompts((6,), seed=7)[0]
    ref = LLMEngine(model).generate([second], PARAMS)
    address, engine, _, _ = servers(model, path, EngineOptions(
        kv_cache_bytes=8 << 20, prefix_cache_bytes=64 << 20, replay_ratio=1.0))
    service = attention(model)
    client = PrefillClient([address], model.config, model.dtype)
    decode_prefilled(service, client, [base])
    got = decode_prefilled(service, client, [second])
    assert got[0].output_ids == ref[0].output_ids
    assert (torch.stack(got[0].logits) - torch.stack(ref[0].logits)).abs().max() <= 1e-4
    no_leaks(engine, service)


def test_refusals_name_the_field(tiny_checkpoint, servers):
    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path)
    address, engine, _, _ = servers(model, path)
    client = PrefillClient([address], model.config, model.dtype)
    with pytest.raises(PrefillRefused) as exc:      # no maps on this replica
        client.prefill(prompts()[0], options_to_proto(PrefillRequest("ridgefill", None), None))
    assert exc.value.field == "prefill_mode"
    with pytest.raises(PrefillRefused, match="must be one of") as exc:     # not "no maps"
        client.prefill(prompts()[0], pb.PrefillOptions(mode="fast"))
    assert exc.value.field == "prefill_mode"
    with pytest.raises(PrefillRefused) as exc:
        client.prefill(prompts()[0], pb.PrefillOptions(has_replay_ratio=True,
                                                        replay_ratio=1.5))
    assert exc.value.field == "replay_ratio"
    with pytest.raises(PrefillRefused) as exc:
        client.prefill([], pb.PrefillOptions())
    assert exc.value.field == "prompt"
    no_leaks(engine)


def test_ridgefill_settings_checked_by_the_service(tiny_checkpoint, servers):
    """With RidgeFill enabled (identity fill needs no maps), a filled prefill runs there and
    bad settings are refused with the reason."""
    from services.prefill.service import PrefillConfig

    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path)
    address, engine, registry, _ = servers(model, path, EngineOptions(
        kv_cache_bytes=8 << 20, prefill=PrefillConfig(mode="ridgefill", split=1, tail=4)))
    service = attention(model)
    client = PrefillClient([address], model.config, model.dtype)
    opts = options_to_proto(PrefillRequest("ridgefill", {"fill": "identity", "tail": 4}), None)
    got = decode_prefilled(service, client, prompts((40,)), options=opts)
    assert len(got[0].output_ids) == PARAMS.max_tokens
    filled = sum(m.value for fam in registry.collect() for m in fam.samples
                 if m.name == "splitstack_ridgefill_filled_rows_total")
    assert filled > 0
    with pytest.raises(PrefillRefused, match="selector"):
        client.prefill(prompts()[0], options_to_proto(
            PrefillRequest("ridgefill", {"fill": "identity", "selector": "psychic"}), None))
    no_leaks(engine, service)


def test_dead_replica_is_retried_on_another(tiny_checkpoint, servers):
    path, _ = tiny_checkpoint("qwen3_next")
    model = load_model(path)
    ref = LLMEngine(model).generate(prompts(), PARAMS)
    a0, _, _, server0 = servers(model, path, name="prefill-0")
    a1, engine1, _, _ = servers(model, path, name="prefill-1")
    client = PrefillClient([a0, a1], model.config, model.dtype)
    server0.stop(0)                   # replica 0 is gone: every prefill lands on replica 1
    service = attention(model)
    got = decode_prefilled(service, client, prompts())
    assert [r.output_ids for r in got] == [s.output_ids for s in ref]
    assert client.retries > 0
    no_leaks(engine1, service)
    server1 = [a1]
    with pytest.raises(PrefillFailed, match="no prefill replica"):
        PrefillClient([a0], model.config, model.dtype).prefill(prompts()[0],
                                                                pb.PrefillOptions())
    assert server1


def test_cancelled_prefill_frees_its_blocks(tiny_checkpoint, servers):
    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path)
    address, engine, _, _ = servers(model, path)
    client = PrefillClient([address], model.config, model.dtype)
    cancel = CancelHandle()
    cancel.cancel()
    with pytest.raises(PrefillCancelled):
        client.prefill(prompts()[0], pb.PrefillOptions(), cancel)
    # a call cancelled after its acknowledgement: the replica aborts it (or it had finished)
    stub = pb_grpc.PrefillStub(grpc.insecure_channel(address))
    call = stub.Prefill(pb.PrefillRequest(prompt_ids=prompts((300,))[0]))
    assert next(call).ack.num_tokens == 300
    call.cancel()
    done = threading.Event()
    for _ in range(100):
        if engine.blocks.num_free == engine.blocks.num_blocks and not engine.has_unfinished():
            done.set()
            break
        done.wait(0.05)
    assert done.is_set()
    no_leaks(engine)


def test_generate_over_grpc_with_prefill_service(tiny_checkpoint, servers):
    """The attention service's gRPC API with a prefill client: tokens as the engine's; a
    refusal from the prefill service comes back as a refused first event with its field."""
    path, _ = tiny_checkpoint("qwen3_5")
    model = load_model(path)
    params = GenerationParams(max_tokens=6, ignore_eos=True)
    ref = LLMEngine(model).generate(prompts(), params)
    address, engine, _, _ = servers(model, path)
    service = attention(model)
    server, att_address, loop = serve_attention(
        service, prefill=PrefillClient([address], model.config, model.dtype))
    try:
        stub = pb_grpc.AttentionStub(grpc.insecure_channel(att_address))
        from services.common.codec import params_to_proto

        for p, r in zip(prompts(), ref):
            events = list(stub.Generate(params_to_proto(p, params)))
            assert [e.token for e in events if e.has_token] == r.output_ids
        bad = params_to_proto(prompts()[0], GenerationParams(
            max_tokens=4, prefill=PrefillRequest("ridgefill", {"split": 2})))
        first = next(iter(stub.Generate(bad)))
        assert first.refused and first.error_field == "prefill_mode"
    finally:
        server.stop(0)
        loop.shutdown()
    no_leaks(engine, service)


def test_cache_aware_routing_sends_a_prefix_where_it_is_cached(tiny_checkpoint, servers):
    """Two replicas with memory-only prefix caches: prompts sharing a stored prefix go to
    the replica that holds it (every one a hit there), not round robin."""
    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path)
    options = EngineOptions(kv_cache_bytes=8 << 20, prefix_cache_bytes=64 << 20)
    a0, e0, r0, _ = servers(model, path, options, name="prefill-0")
    a1, e1, r1, _ = servers(model, path, options, name="prefill-1")
    client = PrefillClient([a0, a1], model.config, model.dtype, cache_aware=True)
    base = prompts((50,))[0]
    client.prefill(base, pb.PrefillOptions())
    e0.prefix.drain()
    e1.prefix.drain()
    for seed in (5, 6, 7):
        client.prefill(base[:40] + prompts((8,), seed=seed)[0], pb.PrefillOptions())

    def hits(registry):
        return sum(m.value for fam in registry.collect() for m in fam.samples
                   if m.name == "splitstack_prefix_cache_hit_tokens_total")
    assert sorted([hits(r0), hits(r1)]) == [0, 3 * 40]
    plain = PrefillClient([a0, a1], model.config, model.dtype)     # round robin: misses
    before = hits(r0) + hits(r1)
    for seed in (8, 9):
        plain.prefill(base[:40] + prompts((8,), seed=seed)[0], pb.PrefillOptions())
    assert hits(r0) + hits(r1) - before < 2 * 40
