"""The OpenAI-compatible gateway over real HTTP, driven by the official `openai` client."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from kernels.sampling import SamplingParams
from services.engine import GenerationParams, LLMEngine
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from tests.helpers.gateway import MODEL, ZOO, client, running, wait_idle

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_and_health(server):
    base, _ = server
    assert [m.id for m in client(base).models.list().data] == [MODEL]
    assert httpx.get(base + "/health").json()["status"] == "ok"


def test_chat_completion_answers(server):
    base, gateway = server
    resp = client(base).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24,
                                                temperature=0)
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens > 10 and resp.usage.completion_tokens > 0
    eng = wait_idle(gateway)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_streaming_equals_non_streaming(server):
    base, _ = server
    c = client(base)
    full = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20,
                                     temperature=0).choices[0].message.content
    chunks = list(c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20,
                                            temperature=0, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full and chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[0].choices[0].delta.role == "assistant"


def test_completion_with_token_ids_stop_and_seed(server):
    base, _ = server
    c = client(base)
    resp = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                temperature=0)
    text = resp.choices[0].text
    assert resp.choices[0].finish_reason in ("length", "stop") and text
    word = text.split()[0]
    cut = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                               temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and word not in cut.choices[0].text
    a, b = (c.completions.create(model=MODEL, prompt=[504, 3575, 282], max_tokens=8,
                                 temperature=1.0, top_p=0.9, seed=5).choices[0].text
            for _ in range(2))
    assert a == b


@pytest.mark.parametrize("body,status,param", [
    ({"model": "gpt-4", "prompt": "hi", "max_tokens": 4}, 404, "model"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "", "max_tokens": 4}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "four"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": 2**70}, 400, "seed"),
    # JSON types are not coerced
    ({"model": MODEL, "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2.0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": "0.5"}, 400,
     "temperature"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "prompt": [1.5, 2], "max_tokens": 2}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 17}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop_token_ids": [49152]}, 400,
     "stop_token_ids"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 3, "best_of": 2}, 400, "best_of"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "best_of": 2, "stream": True}, 400,
     "best_of"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 2, "best_of": 2}, 400, "best_of"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": -1}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": True}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 2, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 2, "logprobs": True,
      "top_logprobs": 21}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 2, "echo": True}, 400, "echo"),
    # OpenAI fields not implemented are refused when they ask for something
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "suffix": "!"}, 400, "suffix"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "frequency_penalty": 2.5}, 400,
     "frequency_penalty"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "logit_bias": {"one": 5}}, 400,
     "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "logit_bias": {"49152": 5}}, 400,
     "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "logit_bias": {"1": 500}}, 400,
     "logit_bias"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 2,
      "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 2, "tool_choice": "required"}, 400,
     "tool_choice"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2,
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     400, "messages"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    base, gateway = server
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    resp = httpx.post(base + path, json=body, timeout=30)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param
    eng = wait_idle(gateway)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_usage_counts_generated_tokens_and_streams_with_include_usage(server):
    """usage.completion_tokens is the number of tokens generated (not the answer text
    tokenized again), and `stream_options.include_usage` ends the stream with it."""
    base, gateway = server
    c = client(base)
    fixed = c.completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=6,
                                 temperature=0, extra_body={"ignore_eos": True})
    assert fixed.usage.completion_tokens == 6
    assert fixed.usage.total_tokens == fixed.usage.prompt_tokens + 6
    full = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24,
                                     temperature=0)
    assert full.choices[0].finish_reason == "stop"      # ended by the end-of-turn token
    served = gateway.backend.engine       # driven by the server's thread: a second engine
    ref = LLMEngine(served.model, eos_token_ids=served.eos_token_ids).generate(
        [gateway.chat_ids(ChatCompletionRequest(model=MODEL, messages=QUESTION))],
        GenerationParams(max_tokens=24))[0]
    assert full.usage.completion_tokens == len(ref.output_ids)
    chunks = list(c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(ch.usage is None for ch in chunks[:-1]) and not chunks[-1].choices
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    plain = list(c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4,
                                           temperature=0, stream=True))
    assert all(ch.choices and ch.usage is None for ch in plain)     # no usage chunk unasked
    eng = wait_idle(gateway)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_fields_at_their_defaults_are_served(server):
    """Clients that send every field (LangChain and others send the penalties as 0 and
    `logprobs: false`; some send null) get an answer; so do the extreme seeds torch
    accepts."""
    base, gateway = server
    defaults = {"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": None,
                "logprobs": False, "top_logprobs": 0, "n": 1, "best_of": 1,
                "logit_bias": {}, "echo": False, "tool_choice": "none",
                "response_format": {"type": "text"}, "user": "u1"}
    for seed in (2**64 - 1, -(2**63)):
        resp = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": QUESTION, "max_tokens": 2, "seed": seed, **defaults})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"]
    eng = wait_idle(gateway)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_malformed_json_then_still_serving(server):
    base, _ = server
    resp = httpx.post(base + "/v1/completions", content=b"{not json",
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    ok = client(base).completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert ok.choices[0].text is not None


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_aborts_and_frees_kv(server, n):
    base, gateway = server
    aborted = gateway.metrics.requests.labels("abort")._value.get()
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "stream": True,
            "ignore_eos": True, "n": n}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert gateway.backend.engine.has_unfinished()
    eng = wait_idle(gateway)
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert gateway.metrics.requests.labels("abort")._value.get() == aborted + n


def test_metrics_exported(server):
    base, _ = server
    client(base).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    text = httpx.get(base + "/metrics").text
    for name in ("splitstack_time_to_first_token_seconds_bucket",
                 "splitstack_e2e_request_latency_seconds_count",
                 "splitstack_kv_cache_usage_ratio", "splitstack_generation_tokens_total"):
        assert name in text


def test_non_streaming_disconnect_aborts_and_frees_kv(server):
    base, gateway = server
    aborted = gateway.metrics.requests.labels("abort")._value.get()
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/completions", json=body, timeout=1.5)   # the client gives up
    eng = wait_idle(gateway)
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert gateway.metrics.requests.labels("abort")._value.get() == aborted + 1


def test_request_without_max_tokens_uses_the_remaining_context(server):
    """The README's curl example: no max_tokens (up to the context) and no temperature
    (the checkpoint's generation_config says greedy), so it answers and stops at EOS."""
    base, gateway = server
    resp = httpx.post(base + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": QUESTION})
    assert resp.status_code == 200, resp.text
    assert "Paris" in resp.json()["choices"][0]["message"]["content"]
    models = httpx.get(base + "/v1/models").json()["data"][0]
    eng = gateway.backend.engine
    assert models["max_model_len"] == eng.max_model_len
    assert eng.blocks.blocks_for(eng.max_model_len) <= eng.blocks.num_blocks


def reference_logprobs(gateway, ids: list[int], max_tokens: int):
    """Greedy tokens and each step's log-softmax from a second engine on the served model."""
    served = gateway.backend.engine
    seq = LLMEngine(served.model, eos_token_ids=served.eos_token_ids).generate(
        [ids], GenerationParams(max_tokens=max_tokens, return_logits=True))[0]
    return seq.output_ids, [torch.log_softmax(lg.float(), -1) for lg in seq.logits]


def test_completion_logprobs_are_the_models_own_and_stream_the_same(server):
    base, gateway = server
    c = client(base)
    prompt = "The capital of France is"
    resp = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                logprobs=3, extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    lp = choice.logprobs
    ids = gateway.completion_ids(CompletionRequest(model=MODEL, prompt=prompt))[0]
    tokens, ref = reference_logprobs(gateway, ids, 6)
    words = gateway.words
    assert lp.tokens == [words.text(t) for t in tokens]
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for t, got, top, row in zip(tokens, lp.token_logprobs, lp.top_logprobs, ref):
        assert abs(got - row[t].item()) < 1e-4
        best = row.topk(3)
        assert list(top) == [words.text(i) for i in best.indices.tolist()]   # greedy: in it
        assert max(abs(top[words.text(i)] - v) for i, v in
                   zip(best.indices.tolist(), best.values.tolist())) < 1e-4
    streamed = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                         temperature=0, logprobs=3, stream=True,
                                         extra_body={"ignore_eos": True}))
    joined = {k: sum((getattr(ch.choices[0].logprobs, k) for ch in streamed), [])
              for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert joined == {k: getattr(lp, k) for k in joined}
    plain = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    eng = wait_idle(gateway)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_chat_logprobs_cover_every_token_and_their_bytes_spell_the_answer(server):
    """One entry per generated token (the end-of-turn token included, as usage counts
    them), the asked number of alternatives, and `bytes` that join into the answer's UTF-8
    even where a token holds only part of a character."""
    base, gateway = server
    c = client(base)
    for messages in (QUESTION, [{"role": "user", "content": "Say 日本"}]):
        resp = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                         temperature=0, logprobs=True, top_logprobs=2)
        content = resp.choices[0].logprobs.content
        assert len(content) == resp.usage.completion_tokens
        special = {gateway.words.text(t) for t in gateway.tokenizer.all_special_ids}
        spelled = b"".join(bytes(e.bytes) for e in content if e.token not in special)
        assert spelled.decode("utf-8") == resp.choices[0].message.content
        for e in content:
            assert [a.logprob for a in e.top_logprobs] == sorted(
                (a.logprob for a in e.top_logprobs), reverse=True)
            assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob
        streamed = [ch.choices[0].logprobs.content
                    for ch in c.chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=12, temperature=0,
                        logprobs=True, top_logprobs=2, stream=True)
                    if ch.choices and ch.choices[0].logprobs]
        assert [e.model_dump() for part in streamed for e in part] == [
            e.model_dump() for e in content]
    assert any(e.token == "\ufffd" for e in content)     # a part of a character was there
    only = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3,
                                     temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in only.choices[0].logprobs.content)
    eng = wait_idle(gateway)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_penalties_and_logit_bias_change_the_answer_as_the_engine_does(server):
    """A looping answer ("1. 1\n2. 2\n...") under each penalty and a logit bias, against a
    second engine on the served model with the same sampling settings."""
    base, gateway = server
    c = client(base)
    messages = [{"role": "user", "content": "List the numbers from one to ten."}]
    ids = gateway.chat_ids(ChatCompletionRequest(model=MODEL, messages=messages))
    served = gateway.backend.engine
    plain = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                      temperature=0).choices[0].message.content
    newline = gateway.tokenizer("\n", add_special_tokens=False)["input_ids"][0]
    # the model is sure enough of its loop that a presence penalty of 2 alone keeps it
    # (every repeated token's logit leads by more than 2): that row checks equality only
    for body, sampling, changes in [
            ({"extra_body": {"repetition_penalty": 1.3}}, SamplingParams(repetition_penalty=1.3),
             True),
            ({"frequency_penalty": 1.5}, SamplingParams(frequency_penalty=1.5), True),
            ({"presence_penalty": 2.0}, SamplingParams(presence_penalty=2.0), False),
            ({"logit_bias": {str(newline): -100}}, SamplingParams(logit_bias=((newline, -100),)),
             True)]:
        got = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                        temperature=0, **body).choices[0].message.content
        ref = LLMEngine(served.model, eos_token_ids=served.eos_token_ids).generate(
            [ids], GenerationParams(max_tokens=24, sampling=sampling))[0]
        assert got == gateway.tokenizer.decode(ref.output_ids, skip_special_tokens=True)
        assert (got != plain) == changes, body
    eng = wait_idle(gateway)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def seeded_runs(gateway, ids, seeds, max_tokens, ignore_eos=False):
    served = gateway.backend.engine
    engine = LLMEngine(served.model, eos_token_ids=served.eos_token_ids)
    return engine.generate([ids] * len(seeds), [GenerationParams(
        max_tokens=max_tokens, ignore_eos=ignore_eos,
        sampling=SamplingParams(temperature=1.0, seed=s)) for s in seeds])


def test_n_choices_are_seed_plus_index_runs_streamed_or_not(server):
    """`n`: one request per choice; with `seed`, choice i draws as a request with seed + i
    (each reproducible); usage counts every choice's tokens; streamed chunks carry their
    choice's index and join into the same texts."""
    base, gateway = server
    c = client(base)
    messages = [{"role": "user", "content": "Tell me a fruit."}]
    resp = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                     temperature=1.0, seed=7, n=3)
    ids = gateway.chat_ids(ChatCompletionRequest(model=MODEL, messages=messages))
    refs = seeded_runs(gateway, ids, [7, 8, 9], 10)
    texts = [ch.message.content for ch in sorted(resp.choices, key=lambda ch: ch.index)]
    assert texts == [gateway.tokenizer.decode(r.output_ids, skip_special_tokens=True)
                     for r in refs]
    assert len(set(texts)) > 1
    assert resp.usage.completion_tokens == sum(len(r.output_ids) for r in refs)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                            temperature=1.0, seed=7, n=3, stream=True,
                                            stream_options={"include_usage": True}))
    joined = ["".join(ch.choices[0].delta.content or "" for ch in chunks
                      if ch.choices and ch.choices[0].index == i) for i in range(3)]
    assert joined == texts and chunks[-1].usage.model_dump() == resp.usage.model_dump()
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].finish_reason) == 3
    eng = wait_idle(gateway)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_best_of_returns_the_most_likely_candidates(server):
    base, gateway = server
    prompt = "My favourite fruit is"
    resp = client(base).completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                           temperature=1.0, seed=3, n=2, best_of=5,
                                           extra_body={"ignore_eos": True})
    ids = gateway.completion_ids(CompletionRequest(model=MODEL, prompt=prompt))[0]
    refs = seeded_runs(gateway, ids, range(3, 8), 6, ignore_eos=True)
    ranked = sorted(refs, key=lambda r: -sum(r.logprobs))
    assert [ch.text for ch in resp.choices] == [
        gateway.tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in ranked[:2]]
    assert all(ch.logprobs is None for ch in resp.choices)       # ranked by, not reported
    assert resp.usage.completion_tokens == 5 * 6                 # every candidate's tokens
    eng = wait_idle(gateway)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_vllm_stop_extensions(server):
    """min_tokens (no end-of-turn, stop token or stop string before it), stop_token_ids,
    include_stop_str_in_output and skip_special_tokens, as vLLM's OpenAI server has them."""
    base, gateway = server
    c = client(base)

    def answer(**extra):
        resp = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30,
                                         temperature=0, extra_body=extra)
        return resp.choices[0].message.content, resp.usage.completion_tokens

    plain, n_plain = answer()
    assert plain == "The capital of France is Paris." and n_plain < 20
    longer, n = answer(min_tokens=20)
    served = gateway.backend.engine
    ids = gateway.chat_ids(ChatCompletionRequest(model=MODEL, messages=QUESTION))
    ref = LLMEngine(served.model, eos_token_ids=served.eos_token_ids).generate(
        [ids], GenerationParams(max_tokens=30, min_tokens=20))[0]
    assert n >= 20 and longer.startswith(plain) and len(longer) > len(plain)
    assert longer == gateway.tokenizer.decode(ref.output_ids, skip_special_tokens=True)
    assert answer(stop=["Paris"])[0] == "The capital of France is "
    assert answer(stop=["Paris"], include_stop_str_in_output=True)[0] == (
        "The capital of France is Paris")
    # "capital" comes before min_tokens: it does not stop the answer
    assert answer(stop=["capital"], min_tokens=5)[0] == plain
    france = gateway.tokenizer(" France", add_special_tokens=False)["input_ids"]
    assert len(france) == 1
    assert answer(stop_token_ids=france)[0] == "The capital of France"
    assert answer(skip_special_tokens=False)[0] == plain + "<|im_end|>"
    eng = wait_idle(gateway)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_echo_returns_the_prompt_with_its_log_probs(server):
    """`echo` with `logprobs` (how evaluation harnesses score a continuation): the prompt
    comes back before the completion, each prompt token after the first with its log-prob
    under the full forward and the k most likely alternatives; streamed the same."""
    base, gateway = server
    c = client(base)
    prompt = "The capital of France is Paris. The capital of Italy is"
    resp = c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                logprobs=2, echo=True, extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    lp = choice.logprobs
    ids = gateway.completion_ids(CompletionRequest(model=MODEL, prompt=prompt))[0]
    words = gateway.words
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    assert lp.tokens[:len(ids)] == [words.text(t) for t in ids]
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    served = gateway.backend.engine
    generated = LLMEngine(served.model).generate(
        [ids], GenerationParams(max_tokens=3, ignore_eos=True))[0].output_ids
    full = torch.log_softmax(served.model.forward(torch.tensor([ids + generated]))[0], -1)
    for j in range(1, len(ids) + 3):
        token = (ids + generated)[j]
        assert abs(lp.token_logprobs[j] - full[j - 1, token].item()) < 1e-4
        best = full[j - 1].topk(2).indices.tolist()
        assert set(lp.top_logprobs[j]) == {words.text(t) for t in best} | {lp.tokens[j]}
    streamed = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=3,
                                         temperature=0, logprobs=2, echo=True, stream=True,
                                         extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in streamed) == choice.text
    assert sum((ch.choices[0].logprobs.token_logprobs for ch in streamed), []) == (
        lp.token_logprobs)
    bare = c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                echo=True, extra_body={"ignore_eos": True})
    assert bare.choices[0].text == choice.text and bare.choices[0].logprobs is None
    eng = wait_idle(gateway)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_a_batch_of_prompts_gets_n_choices_each(server):
    """A list of prompts (texts or token lists, as evaluation harnesses batch them): the
    choices come back indexed prompt·n + choice, each the engine's answer to its prompt,
    streamed too; usage sums over the batch."""
    base, gateway = server
    c = client(base)
    texts = ["The capital of France is", "One, two, three,", "Water boils at"]
    resp = c.completions.create(model=MODEL, prompt=texts, max_tokens=5, temperature=0, n=2,
                                echo=True, extra_body={"ignore_eos": True})
    served = gateway.backend.engine
    ids = [gateway.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    refs = LLMEngine(served.model).generate(ids, GenerationParams(max_tokens=5,
                                                                  ignore_eos=True))
    want = [t + gateway.tokenizer.decode(r.output_ids, skip_special_tokens=True)
            for t, r in zip(texts, refs)]
    got = sorted(resp.choices, key=lambda ch: ch.index)
    assert [ch.index for ch in got] == list(range(6))
    assert [ch.text for ch in got] == [w for w in want for _ in range(2)]   # greedy: n alike
    assert resp.usage.prompt_tokens == sum(map(len, ids))
    assert resp.usage.completion_tokens == 6 * 5
    by_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
    joined = {}
    for ch in by_ids:
        joined[ch.choices[0].index] = joined.get(ch.choices[0].index, "") + ch.choices[0].text
    assert [joined[i] for i in range(3)] == [w[len(t):] for w, t in zip(want, texts)]
    too_many = httpx.post(base + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": ["hi"] * 129, "max_tokens": 1})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"
    eng = wait_idle(gateway)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_api_key_guards_the_v1_routes():
    """`--api-key`: /v1/ needs the bearer token (401 otherwise, nothing runs); /health and
    /metrics stay open for probes and scrapers."""
    from services.deployment.server import build_embedded

    app = build_embedded(ZOO, served_name=MODEL, api_key="s3cret")
    with running(app) as base:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(base + "/v1/models").status_code == 401
        assert httpx.get(base + "/health").status_code == 200
        assert httpx.get(base + "/metrics").status_code == 200
        keyed = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0)
        assert keyed.completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices
        streamed = "".join(ch.choices[0].text for ch in keyed.completions.create(
            model=MODEL, prompt="Hello", max_tokens=4, stream=True))
        assert streamed
        with pytest.raises(openai.AuthenticationError):
            client(base).completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        engine = app.state.gateway.backend.engine
        assert engine.blocks.num_free == engine.blocks.num_blocks


def test_tokenize_and_detokenize(server):
    """vLLM's /tokenize (a prompt, or messages through the chat template, exactly what a
    chat request runs) and /detokenize, with their 4xx."""
    base, gateway = server
    text = "The capital of France is"
    got = httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": text}).json()
    ids = gateway.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert got == {"tokens": ids, "count": len(ids), "max_model_len": gateway.max_model_len}
    chat = httpx.post(base + "/tokenize", json={"model": MODEL, "messages": QUESTION}).json()
    assert chat["tokens"] == gateway.chat_ids(ChatCompletionRequest(model=MODEL,
                                                                    messages=QUESTION))
    back = httpx.post(base + "/detokenize", json={"model": MODEL, "tokens": ids}).json()
    assert back == {"prompt": text}
    for path, body, status, param in [
            ("/tokenize", {"model": MODEL}, 400, "prompt"),
            ("/tokenize", {"model": MODEL, "prompt": "a", "messages": QUESTION}, 400, "prompt"),
            ("/tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
            ("/detokenize", {"model": MODEL, "tokens": [1, 49152]}, 400, "tokens"),
            ("/detokenize", {"model": MODEL, "tokens": ["a"]}, 400, "tokens")]:
        r = httpx.post(base + path, json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_concurrent_fanned_out_streams_with_disconnects_leak_nothing(server):
    """Eight streamed requests at once, each with n = 2 choices and log-probs; every other
    client hangs up after a few chunks. The rest finish whole, every choice's KV comes
    back, and the server serves on."""
    from concurrent.futures import ThreadPoolExecutor

    base, gateway = server
    aborted = gateway.metrics.requests.labels("abort")._value.get()

    def one(i: int):
        body = {"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": 24,
                "ignore_eos": True, "stream": True, "n": 2, "logprobs": 1,
                "temperature": 1.0, "seed": i}
        chunks, tokens = 0, [0, 0]
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    tokens[choice["index"]] += len(choice["logprobs"]["tokens"])
                    chunks += 1
                    if i % 2 and chunks == 4:
                        return None                       # hang up mid-stream
        return tokens

    with ThreadPoolExecutor(8) as ex:
        done = list(ex.map(one, range(8)))
    assert all(t is None for t in done[1::2])
    assert all(t == [24, 24] for t in done[0::2])         # every token of both choices
    eng = wait_idle(gateway, timeout=60)
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert gateway.metrics.requests.labels("abort")._value.get() == aborted + 4 * 2
    assert client(base).completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices
