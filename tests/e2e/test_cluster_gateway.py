"""The gateway in front of the disaggregated deployment: SmolLM2 served by Ray actors (2
attention services, each with its KV split over 2 shards, and 2 MLP pool replicas over the
grpc transport), reached over HTTP with the official `openai` client and raw SSE.

The attention services draft with n-gram speculative decoding, so every test that compares
tokens with the exact engine or with the (non-speculative) embedded server checks that a
speculative greedy answer is the plain one, through migrations and retries too.

The tests run in order: the last one kills an attention service.
"""
from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch

from kernels.sampling import SamplingParams
from models import load_model
from services.deployment.build import EngineOptions
from services.deployment.ray_cluster import ClusterConfig
from services.engine.speculative import NgramConfig
from services.common.tokenizer import load_tokenizer
from services.engine import GenerationParams, LLMEngine
from services.deployment.server import build_cluster
from tests.helpers.gateway import (ZOO, deployment_metrics, fresh_metrics, migrations,
                                   reference_texts, running, stream_completion)

pytestmark = pytest.mark.slow

MAX_TOKENS = 16


def prompt_ids():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(100, 20000, (n,), generator=gen).tolist() for n in (5, 40, 17, 26)]


@pytest.fixture(scope="module")
def reference():
    return reference_texts(prompt_ids(), MAX_TOKENS)


@pytest.fixture(scope="module")
def cluster(ray_session):
    config = ClusterConfig(model=str(ZOO), attention_shards=2, kv_splits=2, mlp_replicas=2,
                           transport="grpc", kv_cache_bytes=128 << 20, max_num_seqs=8,
                           prefill=EngineOptions(speculative=NgramConfig(4, 4, 2,
                                                                          adaptive=False)))
    app, cluster = build_cluster(config, served_name="smollm2-135m")
    with running(app) as base:
        yield base, cluster
    cluster.shutdown()


def concurrently(base, on_started=None):
    """Four streaming requests at once; `on_started` runs once each has its first token."""
    starts = [threading.Event() for _ in prompt_ids()]
    with ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(stream_completion, base, ids, MAX_TOKENS, ev) for ids, ev in zip(prompt_ids(), starts)]
        if on_started is not None:
            for ev in starts:
                assert ev.wait(120)
            on_started()
        return [f.result() for f in futures]


def assert_no_leaks(ray, actors):
    for actor in actors:
        free, total = ray.get(actor.blocks.remote())
        assert free == total


def test_openai_client_gets_the_exact_engines_tokens(cluster, reference, ray_session):
    base, handles = cluster
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda ids: client.completions.create(
            model="smollm2-135m", prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].text, prompt_ids()))
    assert got == reference
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2-135m", prompt=prompt_ids()[1], max_tokens=MAX_TOKENS, temperature=0,
        stream=True, extra_body={"ignore_eos": True}))
    assert streamed == reference[1]
    chat = client.chat.completions.create(model="smollm2-135m", max_tokens=8,
                                          messages=[{"role": "user", "content": "Hi!"}])
    assert chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
    assert_no_leaks(ray_session, handles.attention)
    metrics = fresh_metrics(base)                        # a poll of the members after the load
    assert "splitstack_kv_cache_usage_ratio" in metrics
    for address in handles.attention_addresses:          # one series per attention service
        assert f'splitstack_attention_up{{member="{address}"}} 1.0' in metrics
        assert f'splitstack_attention_requests_running{{member="{address}"}} 0.0' in metrics
    for address in handles.pool_addresses:     # each replica's own /metrics
        assert f'splitstack_pool_up{{member="{address}"}} 1.0' in metrics
        stages = re.search(rf'^splitstack_pool_stage_seconds_count\{{kind="stage",'
                           rf'member="{re.escape(address)}"\}} (\S+)$', metrics, re.M)
        assert stages and float(stages.group(1)) > 0
        assert f'splitstack_pool_batch_rows_bucket{{le="1.0",member="{address}"}}' in metrics


def test_logprobs_travel_from_the_attention_service(cluster, ray_session):
    """`logprobs` over the disaggregated path: the attention service ranks the pool's
    logits, the alternatives cross gRPC and the gateway formats them; the values are the
    exact engine's (same tokens, log-probs within float error of the merged attention)."""
    base, handles = cluster
    ids = prompt_ids()[2]
    seq = LLMEngine(load_model(ZOO)).generate([ids], GenerationParams(
        max_tokens=MAX_TOKENS, ignore_eos=True, return_logits=True))[0]
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    lp = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=MAX_TOKENS,
                                   temperature=0, logprobs=2,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    tok = load_tokenizer(ZOO)
    assert lp.tokens == [tok.decode([t]) for t in seq.output_ids]
    for t, got, top, logits in zip(seq.output_ids, lp.token_logprobs, lp.top_logprobs,
                                   seq.logits):
        row = torch.log_softmax(logits.float(), -1)
        best = row.topk(2)
        assert abs(got - row[t].item()) < 1e-3
        assert list(top) == [tok.decode([i]) for i in best.indices.tolist()]
        assert max(abs(a - b) for a, b in zip(top.values(), best.values.tolist())) < 1e-3
    echoed = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=4,
                                       temperature=0, echo=True, logprobs=2,
                                       extra_body={"ignore_eos": True}).choices[0]
    assert echoed.text == tok.decode(ids) + tok.decode(seq.output_ids[:4])
    # the prompt's log-probs: the pool scores the prompt rows the attention service computed
    full = torch.log_softmax(load_model(ZOO).forward(torch.tensor([ids]))[0], -1)
    lp = echoed.logprobs
    assert lp.tokens[:len(ids)] == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 4
    for j in range(1, len(ids)):
        assert abs(lp.token_logprobs[j] - full[j - 1, ids[j]].item()) < 1e-3
        assert set(lp.top_logprobs[j]) == {tok.decode([t]) for t in full[j - 1].topk(2).indices
                                           .tolist()} | {lp.tokens[j]}
    assert_no_leaks(ray_session, handles.attention)


def test_penalties_and_logit_bias_reach_the_pool(cluster, ray_session):
    """Penalties and logit bias cross gateway -> attention service -> pool (with the
    request's tokens on each final call): the same tokens as the exact engine."""
    base, handles = cluster
    ids = prompt_ids()[0]
    model = load_model(ZOO)
    first = LLMEngine(model).generate([ids], GenerationParams(max_tokens=1))[0].output_ids[0]
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    tok = load_tokenizer(ZOO)
    for temperature, seed in ((0.0, None), (0.9, 5)):
        sampling = SamplingParams(temperature=temperature, seed=seed, presence_penalty=0.2,
                                  frequency_penalty=0.4, repetition_penalty=1.3,
                                  logit_bias=((first, -100.0),))
        ref = LLMEngine(model).generate([ids], GenerationParams(
            max_tokens=MAX_TOKENS, ignore_eos=True, sampling=sampling))[0].output_ids
        got = client.completions.create(
            model="smollm2-135m", prompt=ids, max_tokens=MAX_TOKENS, temperature=temperature,
            seed=seed, presence_penalty=0.2, frequency_penalty=0.4,
            logit_bias={str(first): -100},
            extra_body={"ignore_eos": True, "repetition_penalty": 1.3}).choices[0].text
        assert got == tok.decode(ref, skip_special_tokens=True) and ref[0] != first
    # min_tokens bans the stop token on the pool until the fifth token
    params = GenerationParams(max_tokens=MAX_TOKENS, min_tokens=5, stop_token_ids=(first,))
    ref = LLMEngine(model).generate([ids], params)[0].output_ids
    got = client.completions.create(
        model="smollm2-135m", prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"min_tokens": 5, "stop_token_ids": [first]}).choices[0].text
    assert got == tok.decode(ref, skip_special_tokens=True) and len(ref) >= 5
    assert ref[0] != first
    assert_no_leaks(ray_session, handles.attention)


def test_n_choices_over_the_cluster(cluster, ray_session):
    """n = 3 seeded choices, each its own request on the attention services: seed + i."""
    base, handles = cluster
    ids = prompt_ids()[3]
    model = load_model(ZOO)
    refs = LLMEngine(model).generate([ids] * 3, [GenerationParams(
        max_tokens=MAX_TOKENS, ignore_eos=True,
        sampling=SamplingParams(temperature=1.0, seed=21 + i)) for i in range(3)])
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    resp = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=MAX_TOKENS,
                                     temperature=1.0, seed=21, n=3,
                                     extra_body={"ignore_eos": True})
    tok = load_tokenizer(ZOO)
    assert [ch.text for ch in sorted(resp.choices, key=lambda ch: ch.index)] == [
        tok.decode(r.output_ids, skip_special_tokens=True) for r in refs]
    assert resp.usage.completion_tokens == 3 * MAX_TOKENS
    assert_no_leaks(ray_session, handles.attention)


@pytest.mark.parametrize("body,status,param", [
    ({"model": "nope", "prompt": "hi"}, 404, "model"),
    ({"model": "smollm2-135m", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "smollm2-135m", "prompt": "hi", "max_tokens": 10 ** 7}, 400, "max_tokens"),
    ({"model": "smollm2-135m", "prompt": ""}, 400, "prompt"),
    ({"model": "smollm2-135m", "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    # out-of-vocabulary ids: the request's 400, not every pool replica failing (was a 500)
    ({"model": "smollm2-135m", "prompt": [1, 49152], "max_tokens": 2}, 400, "prompt"),
    ({"model": "smollm2-135m", "prompt": [-1], "max_tokens": 2}, 400, "prompt"),
    ({"model": "smollm2-135m", "prompt": "hi", "max_tokens": 2, "logprobs": 21}, 400,
     "logprobs"),
    ({"model": "smollm2-135m", "prompt": "hi", "max_tokens": 2, "logit_bias": {"49152": 1}},
     400, "logit_bias"),
    (b"{not json", 400, None),
])
def test_bad_requests_get_4xx_and_service_keeps_serving(cluster, body, status, param):
    base, _ = cluster
    if isinstance(body, bytes):
        r = httpx.post(base + "/v1/completions", content=body,
                       headers={"content-type": "application/json"})
    else:
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param
    ok = httpx.post(base + "/v1/completions", timeout=60,
                    json={"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200


def test_client_disconnect_cancels_the_request_and_frees_its_kv(cluster, ray_session):
    import time

    base, handles = cluster
    body = {"model": "smollm2-135m", "prompt": prompt_ids()[1], "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass                              # one token is out: the request holds KV
        used = [t - f for f, t in ray_session.get([a.blocks.remote()
                                                    for a in handles.attention])]
        assert sum(used) > 0
    deadline = time.time() + 30               # hung up long before 400 tokens
    while time.time() < deadline:
        if all(f == t for f, t in ray_session.get([a.blocks.remote()
                                                   for a in handles.attention])):
            break
        time.sleep(0.2)
    assert_no_leaks(ray_session, handles.attention)


@pytest.fixture(scope="module")
def embedded():
    """The embedded deployment with the cluster's limits (the same KV bytes per attention
    service, so the same context length), for the parity test."""
    from services.deployment.server import build_embedded

    app = build_embedded(ZOO, served_name="smollm2-135m", kv_cache_bytes=128 << 20,
                         max_num_seqs=8)
    with running(app) as base:
        yield base


def parity_requests(tok) -> list[tuple[str, dict]]:
    """Requests both deployments must answer alike: greedy and seeded, penalties, stop
    strings, a prompt longer than one prefill chunk (512), prompts over the limit, bad ids."""
    gen = torch.Generator().manual_seed(5)
    long = torch.randint(100, 20000, (700,), generator=gen).tolist()
    over = torch.randint(100, 20000, (2900,), generator=gen).tolist()
    count = "1, 2, 3, 4, 5,"
    base = {"model": "smollm2-135m", "max_tokens": 12}
    return [
        ("completions", {**base, "prompt": prompt_ids()[1], "temperature": 0, "ignore_eos": True}),
        ("completions", {**base, "prompt": "The capital of France is", "temperature": 0.8,
                         "top_p": 0.9, "seed": 7, "n": 2, "logprobs": 2}),
        ("completions", {**base, "prompt": count, "temperature": 0,
                         "repetition_penalty": 1.3, "frequency_penalty": 0.5,
                         "presence_penalty": 0.3, "logit_bias": {"28": 4.0}}),
        ("completions", {**base, "prompt": count, "temperature": 0, "stop": [" 8", "\n"]}),
        ("completions", {**base, "prompt": long, "temperature": 0, "ignore_eos": True}),
        ("chat/completions", {**base, "messages": [{"role": "user", "content": "Say hi."}],
                              "temperature": 0.7, "seed": 3, "min_tokens": 4}),
        ("completions", {**base, "prompt": over, "max_tokens": 100}),
        ("completions", {**base, "prompt": [5, 10**6]}),
        ("completions", {**base, "prompt": prompt_ids()[0], "max_tokens": 9000}),
    ]


def comparable(r: httpx.Response):
    body = r.json()
    if r.status_code != 200:
        return r.status_code, body
    return r.status_code, body["choices"], body["usage"]


def assert_same(a, b, where="") -> None:
    """Equal structures; floats (log-probs) within 1e-4, as the logits are: the pool's
    batched products round differently from the monolithic model's."""
    if isinstance(a, float) or isinstance(b, float):
        assert abs(a - b) <= 1e-4, (where, a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), (where, a, b)
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def test_both_deployments_give_identical_results_and_errors(cluster, embedded, ray_session):
    """One engine for both deployments: the same requests give the same tokens, text,
    log-probs, finish reasons, usage, and the same error status and message."""
    base, _ = cluster
    tok = load_tokenizer(ZOO)
    statuses = []
    for route, body in parity_requests(tok):
        got = [comparable(httpx.post(f"{url}/v1/{route}", json=body, timeout=300))
               for url in (embedded, base)]
        assert_same(got[0], got[1], f"{route} {str(body.get('prompt', body.get('messages')))[:40]}")
        statuses.append(got[0][0])
    assert statuses == [200] * 6 + [400] * 3
    long_usage = comparable(httpx.post(f"{base}/v1/completions",
                                       json=parity_requests(tok)[4][1], timeout=300))[2]
    assert long_usage["prompt_tokens"] == 700


def spec_counter(base: str, name: str) -> float:
    """`splitstack_spec_decode_num_{name}_total` summed over the attention services."""
    return sum(float(line.split()[-1]) for line in deployment_metrics(base).splitlines()
               if line.startswith(f"splitstack_spec_decode_num_{name}_total{{"))


def test_attention_services_draft_and_answer_as_the_plain_embedded_server(cluster, embedded,
                                                                          ray_session):
    """A copy-heavy greedy chat answer: the attention services verify n-gram drafts
    (accepted tokens move on their /metrics), and the answer, whole and streamed, is the
    embedded server's without speculation."""
    import inspect
    import textwrap

    base, handles = cluster
    ask = {"model": "smollm2-135m", "max_tokens": 64, "temperature": 0, "messages": [
        {"role": "user", "content": "Here is a Python function:\n\n```python\n"
         f"{inspect.getsource(textwrap.indent)}```\n\nRewrite it with the function renamed "
         "to `indent_v2`. Reply with the code only."}]}
    before = spec_counter(base, "accepted_tokens")
    want = openai.OpenAI(base_url=embedded + "/v1", api_key="unused").chat.completions.create(
        **ask).choices[0].message.content
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    assert client.chat.completions.create(**ask).choices[0].message.content == want
    chunks = client.chat.completions.create(**ask, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert spec_counter(base, "accepted_tokens") - before > 0
    assert spec_counter(base, "draft_tokens") >= spec_counter(base, "accepted_tokens")
    assert_no_leaks(ray_session, handles.attention)


CITY = {"type": "object", "additionalProperties": False, "required": ["name", "capital"],
        "properties": {"name": {"type": "string", "maxLength": 20},
                       "capital": {"type": "boolean"}}}
CONSTRAINED = [
    {"response_format": {"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY, "strict": True}}},
    {"tools": [{"type": "function", "function": {"name": "describe_city", "parameters": CITY}}],
     "tool_choice": "required", "parallel_tool_calls": False},
]


@pytest.mark.parametrize("constraint", CONSTRAINED, ids=["json_schema", "tool_call"])
def test_a_seeded_constrained_request_is_identical_on_both_deployments(cluster, embedded,
                                                                       constraint, ray_session):
    """The grammar travels with the request to the attention service and its masks to the
    pool: a sampled, seeded constrained answer is the embedded engine's, token for token."""
    base, _ = cluster
    body = {"model": "smollm2-135m", "max_tokens": 48, "temperature": 0.9, "top_p": 0.95,
            "seed": 13, "messages": [{"role": "user", "content": "Describe Paris as JSON."}],
            **constraint}
    answers = []
    for url in (embedded, base):
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        message = choice["message"]
        for call in message.get("tool_calls") or []:
            call.pop("id")                                 # fresh per response
        answers.append((message, choice["finish_reason"], usage))
    assert answers[0] == answers[1]
    message, reason, _ = answers[0]
    if reason in ("stop", "tool_calls"):                   # finished: it is a valid instance
        arguments = (message["content"] if "response_format" in constraint
                     else message["tool_calls"][0]["function"]["arguments"])
        jsonschema.validate(json.loads(arguments), CITY)


def test_killed_mlp_replica_is_retried_with_same_tokens(cluster, reference, ray_session):
    base, handles = cluster
    attention = list(handles.attention)
    results = concurrently(base, on_started=lambda: ray_session.kill(handles.pools[0]))
    assert [err for _, err in results] == [None] * 4
    assert [text for text, _ in results] == reference
    assert_no_leaks(ray_session, attention)


def test_killed_attention_service_migrates_its_requests(cluster, reference, ray_session):
    """kill -9 of an attention actor mid-stream: the gateway re-sends each request it owned,
    with the tokens already streamed, to the live service, and every stream completes with
    the exact engine's output; the client sees no error event."""
    base, handles = cluster
    before = migrations(base, "failure")
    # the pool manager replaces the dead one meanwhile: keep the survivor's handle
    dead, survivor = handles.attention[0], handles.attention[1]
    results = concurrently(base, on_started=lambda: ray_session.kill(dead))
    assert all(err is None for _, err in results), results
    assert [text for text, _ in results] == reference
    assert migrations(base, "failure") - before >= 1      # the dead service owned some of them
    assert "splitstack_migration_pause_seconds_count" in httpx.get(base + "/metrics").text
    assert_no_leaks(ray_session, [survivor])
    again = concurrently(base)             # routed around the dead service
    assert [t for t, _ in again] == reference and all(e is None for _, e in again)
    assert httpx.get(base + "/health").status_code == 200
