"""The gateway with the prefix cache on, over real HTTP: a shared prefix is served from the
cache (visible in /metrics) and answers exactly as the server without a cache does."""
from __future__ import annotations

import re

import httpx
import openai
import pytest

from services.deployment.server import build_embedded
from tests.helpers.gateway import MODEL, ZOO, client, running, wait_idle

pytestmark = pytest.mark.slow

DOCUMENT = "".join(f"Record {i}: the {c} {a} lives in room {100 + 7 * i}.\n"
                   for i, (c, a) in enumerate(zip(["red", "green", "blue", "amber", "violet"] * 8,
                                                  ["fox", "owl", "cat", "eel", "yak"] * 8)))


@pytest.fixture(scope="module")
def cached_server():
    app = build_embedded(ZOO, served_name=MODEL, prefix_cache_bytes=256 << 20)
    with running(app) as base:
        yield base, app.state.gateway


def scrape(base: str, name: str, labels: str) -> float:
    text = httpx.get(base + "/metrics").text
    found = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_shared_prefix_hits_and_answers_as_without_cache(cached_server, server):
    base, gateway = cached_server
    first = DOCUMENT + "Question: where does the blue cat live?\nAnswer:"
    second = DOCUMENT + "Question: where does the amber eel live?\nAnswer:"
    ids = [gateway.tokenizer(t, add_special_tokens=False)["input_ids"] for t in (first, second)]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert shared > 400
    hits = 'tier="memory"'
    before = scrape(base, "splitstack_prefix_cache_hit_tokens_total", hits)
    c = client(base)
    c.completions.create(model=MODEL, prompt=first, max_tokens=4, temperature=0)
    assert scrape(base, "splitstack_prefix_cache_hit_tokens_total", hits) == before
    got = c.completions.create(model=MODEL, prompt=second, max_tokens=12, temperature=0)
    assert scrape(base, "splitstack_prefix_cache_hit_tokens_total", hits) == before + shared
    plain_base, _ = server
    want = client(plain_base).completions.create(model=MODEL, prompt=second, max_tokens=12,
                                                 temperature=0)
    assert got.choices[0].text == want.choices[0].text
    text = httpx.get(base + "/metrics").text
    for name in ("splitstack_prefix_cache_query_tokens_total",
                 "splitstack_prefix_cache_inserted_tokens_total",
                 "splitstack_prefix_cache_memory_bytes", "splitstack_time_to_first_token_seconds"):
        assert name in text
    eng = wait_idle(gateway)
    eng.prefix.drain()
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert eng.prefix.cache.stats().pinned_blocks == 0


def test_replay_ratio_is_a_request_field(cached_server):
    base, _ = cached_server
    c = client(base)
    ok = c.completions.create(model=MODEL, prompt="Hello", max_tokens=2,
                              extra_body={"replay_ratio": 0.5})
    assert ok.choices[0].text is not None
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=MODEL, prompt="Hello", max_tokens=2,
                             extra_body={"replay_ratio": 1.5})
    assert err.value.body["param"] == "replay_ratio"
