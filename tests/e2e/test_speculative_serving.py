"""n-gram speculative decoding served over real HTTP with the official `openai` client,
the engine in its own process: a copy-heavy greedy answer equals the plain server's, whole
and streamed (several tokens a step reach the stream intact), the acceptance counters move
on /metrics, and a seeded sampled request drafts and keeps the plain server's answer."""
from __future__ import annotations

import inspect
import textwrap

import httpx
import pytest

from services.deployment.server import build_embedded
from services.engine.speculative import NgramConfig
from tests.helpers.gateway import MODEL, ZOO, client, running

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Here is a Python function:\n\n```python\n"
        f"{inspect.getsource(textwrap.indent)}```\n\nRewrite it with the function renamed "
        "to `indent_v2`. Reply with the code only."}]


@pytest.fixture(scope="module")
def servers():
    spec = build_embedded(ZOO, kv_cache_bytes=64 << 20, threads=1, engine_process=True,
                          speculative=NgramConfig(4, 4, 2, adaptive=False))
    plain = build_embedded(ZOO, kv_cache_bytes=64 << 20, threads=1)
    with running(spec) as spec_url, running(plain) as plain_url:
        yield spec_url, plain_url


def counter(base: str, name: str) -> float:
    line = next(line for line in httpx.get(base + "/metrics").text.splitlines()
                if line.startswith(f"splitstack_spec_decode_num_{name}_total "))
    return float(line.split()[-1])


def test_greedy_answers_equal_the_plain_servers_whole_and_streamed(servers):
    spec, plain = servers
    before = counter(spec, "accepted_tokens")
    ask = dict(model=MODEL, messages=ASK, max_tokens=96, temperature=0)
    want = client(plain).chat.completions.create(**ask).choices[0].message.content
    got = client(spec).chat.completions.create(**ask)
    assert got.choices[0].message.content == want
    assert got.usage.completion_tokens <= 96
    chunks = client(spec).chat.completions.create(**ask, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    accepted = counter(spec, "accepted_tokens") - before
    assert accepted > 0 and counter(spec, "draft_tokens") >= counter(spec, "accepted_tokens")


def test_a_seeded_sampled_request_drafts_and_keeps_the_plain_servers_tokens(servers):
    """Sampled requests draft too (rejection sampling); with a seed, each row draws with
    the state a plain decode would have at that token, so the answer is the plain
    server's, token for token."""
    spec, plain = servers
    drafts = counter(spec, "drafts")
    ask = dict(model=MODEL, messages=ASK, max_tokens=48, temperature=0.3, seed=3,
               logprobs=True)
    want = client(plain).chat.completions.create(**ask).choices[0]
    got = client(spec).chat.completions.create(**ask).choices[0]
    assert got.message.content == want.message.content
    assert [t.token for t in got.logprobs.content] == [t.token for t in want.logprobs.content]
    assert counter(spec, "drafts") > drafts
