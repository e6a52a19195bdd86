"""Q-First decode with the MLP pool behind real gRPC servers on loopback."""
from __future__ import annotations

import pytest
import torch

from kernels.sampling import SamplingParams
from models import load_model
from services.attention.runner import qfirst_engine
from services.deployment.transports import make_transport
from services.engine import GenerationParams, LLMEngine
from services.mlp_pool import MLPPool
from services.mlp_pool.grpc_server import serve_pool
from tests.helpers.checkpoints import FAMILIES, qfirst_copy
from tests.helpers.pools import PARAMS, generate_stopping_after_prefill, prompts

pytestmark = pytest.mark.slow


def service_over_grpc(model, servers, num_shards=2):
    engine = qfirst_engine(model, make_transport("grpc", [a for _, a in servers]),
                           num_shards=num_shards, block_size=4, num_blocks=64)
    return engine, engine.runner.shards


@pytest.fixture
def pool_servers(request):
    started = []

    def start(model, n):
        for i in range(n):
            started.append(serve_pool(MLPPool(model, f"pool-{i}")))
        return started

    yield start
    for server, _ in started:
        server.stop(0)


@pytest.mark.parametrize("family,num_shards,replicas",
                         [(f, 3, 2) for f in FAMILIES] + [("llama3", 1, 1)])
def test_grpc_pool_matches_exact_engine(family, num_shards, replicas, tiny_checkpoint,
                                        pool_servers):
    path, _ = tiny_checkpoint(family)
    model = load_model(path)
    ref = LLMEngine(model).generate(prompts(), PARAMS)
    service, shards = service_over_grpc(model, pool_servers(model, replicas), num_shards)
    got = service.generate(prompts(), PARAMS)
    for r, s in zip(got, ref):
        assert r.output_ids == s.output_ids
        assert (torch.stack(r.logits) - torch.stack(s.logits)).abs().max().item() <= 1e-4
    service.blocks.check()
    assert service.blocks.num_free == service.blocks.num_blocks


@pytest.mark.parametrize("family", ["llama3", "qwen3_next"])
def test_a_step_runs_as_two_parts_in_flight_at_once(family, tiny_checkpoint, pool_servers):
    """A step of two or more chunks and 4 or more rows over gRPC runs as two parts: each
    layer sends one part's stage call before it reads the other's, so two calls are in
    flight at once and the pool computes one part while this side computes the other. A
    step of one chunk stays one pass; the tokens and logits equal the exact engine's."""
    path, _ = tiny_checkpoint(family)
    model = load_model(path)
    ref = LLMEngine(model).generate(prompts(), PARAMS)
    service, _ = service_over_grpc(model, pool_servers(model, 1), num_shards=2)
    pool, layers = service.runner.pool, model.config.num_hidden_layers
    in_flight, sends = set(), []        # sends: how many calls were in flight after each
    submit = pool.submit

    def counted(method, *args):
        pending = submit(method, *args)
        in_flight.add(pending)
        sends.append(len(in_flight))
        fetch = pending._fetch

        def result():
            in_flight.discard(pending)
            return fetch()
        pending._fetch = result
        return pending

    pool.submit = counted
    ids = [service.add_request(prompts()[0], PARAMS)]
    service.step()                                  # one prompt: one pass
    assert len(sends) == layers and max(sends) == 1
    ids += [service.add_request(p, PARAMS) for p in prompts()[1:]]
    for _ in range(2):       # a decode row and 3 prompts, then 4 decode rows: two parts
        sends.clear()
        service.step()
        assert len(sends) == 2 * layers and max(sends) == 2
    while service.has_unfinished():
        service.step()
    for seq_id, want in zip(ids, ref):
        got = service.pop(seq_id)
        assert got.output_ids == want.output_ids
        assert (torch.stack(got.logits) - torch.stack(want.logits)).abs().max().item() <= 1e-4
    assert service.blocks.num_free == service.blocks.num_blocks


def test_draft_steps_over_grpc_run_in_two_parts_and_give_the_exact_tokens(tiny_checkpoint,
                                                                          pool_servers):
    """n-gram speculative decoding on an attention service over gRPC: draft steps of
    several requests run as the two in-flight parts, every draft row is sampled by the
    pool (a seeded request's rows each with its own sampler state), and the tokens equal
    the plain exact engine's."""
    from services.engine.speculative import NgramConfig

    path, _ = tiny_checkpoint("llama3")
    model = load_model(path)
    phrase = prompts()[2]
    asks = [phrase * 4, prompts()[3], (phrase * 3)[:23]]     # two repeat themselves
    asks.append(phrase * 5)
    params = [PARAMS] * 3 + [GenerationParams(
        max_tokens=PARAMS.max_tokens, ignore_eos=True, return_logits=True,
        sampling=SamplingParams(temperature=0.3, seed=11))]
    ref = LLMEngine(model).generate(asks, params)
    servers = pool_servers(model, 1)
    service = qfirst_engine(model, make_transport("grpc", [servers[0][1]]), num_shards=2,
                            block_size=4, num_blocks=64,
                            speculative=NgramConfig(4, 3, 1, adaptive=False))
    assert service.runner.pool.pipelines
    got = service.generate(asks, params)
    for g, r in zip(got, ref):
        assert g.output_ids == r.output_ids
        assert (torch.stack(g.logits) - torch.stack(r.logits)).abs().max().item() <= 1e-4
    assert 0 < service.spec_stats.accepted_tokens < service.spec_stats.draft_tokens
    assert service.blocks.num_free == service.blocks.num_blocks


def test_killed_pool_replica_is_retried(tiny_checkpoint, pool_servers):
    path, _ = tiny_checkpoint("qwen3_next")
    model = load_model(path)
    ref = [r.output_ids for r in LLMEngine(model).generate(prompts(), PARAMS)]
    servers = pool_servers(model, 2)
    service, _ = service_over_grpc(model, servers)
    got = generate_stopping_after_prefill(service, lambda: servers[0][0].stop(0))
    assert got == ref and service.runner.pool.retries > 0


def test_seeded_sampling_over_grpc_matches_local(tiny_checkpoint, pool_servers):
    from kernels.sampling import SamplingParams

    path, _ = tiny_checkpoint("llama3")
    model = load_model(path)
    params = GenerationParams(max_tokens=8, ignore_eos=True,
                              sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=4))
    local = qfirst_engine(model, make_transport("local", [MLPPool(model)]), block_size=4,
                          num_blocks=64)
    want = [r.output_ids for r in local.generate(prompts(), params)]
    service, _ = service_over_grpc(model, pool_servers(model, 1), num_shards=1)
    assert [r.output_ids for r in service.generate(prompts(), params)] == want


def test_qfirst_wiring_over_grpc_overlaps_and_matches(tiny_checkpoint, pool_servers, tmp_path):
    """Q-first over gRPC: the stage call is sent before the sweep and read after it; the
    tokens and logits still equal the exact engine on the q-first checkpoint."""
    path, _ = tiny_checkpoint("qwen3_5")
    model = load_model(qfirst_copy(path, tmp_path / "qfirst"))
    ref = LLMEngine(model).generate(prompts(), PARAMS)
    servers = pool_servers(model, 1)
    service = qfirst_engine(model, make_transport("grpc", [servers[0][1]]), num_shards=2,
                            block_size=4, num_blocks=64, wiring="qfirst")
    got = service.generate(prompts(), PARAMS)
    for r, s in zip(got, ref):
        assert r.output_ids == s.output_ids
        assert (torch.stack(r.logits) - torch.stack(s.logits)).abs().max().item() <= 1e-4


def test_constrained_decoding_over_the_pool_equals_the_exact_engine(pool_servers):
    """A grammar's token masks travel to the pool with each sampling row: greedy and seeded
    constrained requests on an attention service give the exact engine's tokens, and a
    request migrated mid-answer resumes with its grammar state."""
    import json

    from services.common.messages import StructuredSpec
    from services.deployment.build import grammars_for
    from kernels.sampling import SamplingParams
    from tests.helpers.gateway import ZOO

    model = load_model(ZOO)
    tok_prompt = [1, 4093, 28, 198, 15024, 2520, 347, 18682, 30, 2, 198]
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "ok": {"type": "boolean"}}}
    spec = StructuredSpec("json_schema", json.dumps(schema))
    params = [GenerationParams(max_tokens=40, structured=spec,
                               sampling=SamplingParams(temperature=t, seed=7))
              for t in (0.0, 1.0)]
    exact = LLMEngine(model, eos_token_ids=(2,), grammars=grammars_for(ZOO, 49152))
    want = [s.output_ids for s in exact.generate([tok_prompt] * 2, params)]
    service = qfirst_engine(model, make_transport("grpc", [a for _, a in pool_servers(model, 1)]),
                            num_shards=2, block_size=8, num_blocks=64, eos_token_ids=(2,),
                            grammars=grammars_for(ZOO, 49152))
    got = [s.output_ids for s in service.generate([tok_prompt] * 2, params)]
    assert got == want
    seq_id = service.add_request(tok_prompt, params[0], output_ids=want[0][:6])
    while service.has_unfinished():
        service.step()
    assert service.pop(seq_id).output_ids == want[0]
    assert service.blocks.num_free == service.blocks.num_blocks


def test_grammar_masks_are_filled_while_the_pool_runs_the_layers(pool_servers, monkeypatch):
    """On an attention service a step's masks are computed beside its layer sweep: each
    mask fill waits until the runner sends a stage call it did not see before it began,
    which can only happen if the layers run meanwhile (masks filled first, before the
    layers, would wait in vain); the answer is still the exact engine's."""
    import json
    import threading

    from services.common.messages import StructuredSpec
    from services.deployment.build import grammars_for
    from services.engine import structured
    from tests.helpers.gateway import ZOO

    model = load_model(ZOO)
    prompt = [1, 4093, 28, 198, 15024, 2520, 347, 18682, 30, 2, 198]
    spec = StructuredSpec("json_schema", json.dumps({
        "type": "object", "additionalProperties": False, "required": ["ok"],
        "properties": {"ok": {"type": "boolean"}}}))
    params = GenerationParams(max_tokens=12, structured=spec)
    want = LLMEngine(model, eos_token_ids=(2,), grammars=grammars_for(ZOO, 49152)).generate(
        [prompt], params)[0].output_ids
    service = qfirst_engine(model, make_transport("grpc", [a for _, a in pool_servers(model, 1)]),
                            num_shards=1, block_size=8, num_blocks=64, eos_token_ids=(2,),
                            grammars=grammars_for(ZOO, 49152))
    stages, changed = [0], threading.Condition()
    submit = service.runner.pool.submit

    def counted(name, *args):
        with changed:
            stages[0] += name == "stage"
            changed.notify_all()
        return submit(name, *args)

    overlapped, fill = [], structured.masks

    def waiting_fill(matchers, metrics=None):
        with changed:
            seen = stages[0]
            overlapped.append(changed.wait_for(lambda: stages[0] > seen, timeout=10))
        return fill(matchers, metrics)

    monkeypatch.setattr(service.runner.pool, "submit", counted)
    monkeypatch.setattr(structured, "masks", waiting_fill)
    got = service.generate([prompt], params)[0].output_ids
    assert got == want
    assert len(overlapped) == len(got) and all(overlapped)
    assert service.blocks.num_free == service.blocks.num_blocks
