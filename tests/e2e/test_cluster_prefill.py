"""The disaggregated deployment with a prefill service: SmolLM2 on Ray with 2 prefill
replicas (prefix cache with the shared Redis tier), 1 attention service (KV over 2 shards)
and 1 MLP pool replica, reached over HTTP with the official `openai` client.

Prompts are prefilled on a prefill replica and decoded on the attention service; request
prefill fields are checked by the prefill service (4xx); prompts are routed to the replica
that holds their prefix; a killed prefill replica is retried on the other, which finds its
prefixes in Redis.
The tests run in order: the last one kills a replica.
"""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis

from services.deployment.ray_cluster import ClusterConfig
from services.deployment.build import EngineOptions
from services.deployment.server import build_cluster
from tests.helpers.gateway import ZOO, fresh_metrics, running

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
REDIS_DB = 5            # this module's own database; flushed before the deployment starts
DOCUMENT = "".join(f"Entry {i}: the {c} {a} sleeps in cabin {200 + 9 * i}.\n"
                   for i, (c, a) in enumerate(zip(["red", "green", "blue", "amber", "violet"] * 6,
                                                  ["fox", "owl", "cat", "eel", "yak"] * 6)))


@pytest.fixture(scope="module")
def deployment(ray_session):
    url = f"redis://127.0.0.1:6379/{REDIS_DB}"
    redis.Redis.from_url(url).flushdb()
    options = EngineOptions(max_num_seqs=4, kv_cache_bytes=128 << 20,
                            prefix_cache_bytes=64 << 20, redis_url=url)
    config = ClusterConfig(model=str(ZOO), attention_shards=1, kv_splits=2, mlp_replicas=1,
                           transport="grpc", kv_cache_bytes=128 << 20, max_num_seqs=4,
                           prefill_replicas=2, prefill=options)
    app, cluster = build_cluster(config, served_name=MODEL)
    with running(app) as base:
        yield base, cluster
    cluster.shutdown()


def metric(text: str, name: str, **labels) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def scrape(base: str) -> str:
    return fresh_metrics(base)           # the members' series as a poll after this call saw


def complete(base: str, prompt: str, max_tokens: int = 10, **extra):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, extra_body=extra or None).choices[0].text


def new_block_tokens(prompts: list[list[int]], block_size: int = 16) -> int:
    """Rows Redis is written for these prompts: each distinct chained block once (a prompt
    sharing blocks with an earlier one writes only its own)."""
    blocks = {}
    for ids in prompts:
        for start in range(0, len(ids), block_size):
            blocks[tuple(ids[:start + block_size])] = min(block_size, len(ids) - start)
    return sum(blocks.values())


def no_leaks(ray, cluster, prefills):
    free, total = ray.get(cluster.attention[0].blocks.remote())
    assert free == total
    for i in prefills:
        free, total = ray.get(cluster.prefills[i].blocks.remote())
        assert free == total


def test_prefilled_remotely_answers_as_the_exact_engine(deployment, server, ray_session):
    base, cluster = deployment
    plain, gateway = server
    questions = [DOCUMENT + f"Question: where does the {x} sleep?\nAnswer:"
                 for x in ("blue cat", "amber eel", "violet yak")]
    ids = [gateway.tokenizer(t, add_special_tokens=False)["input_ids"] for t in questions]

    def common(a, b):
        return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)

    # the second prompt hits what the first stored, the third the longer of the two
    want_hits = common(ids[0], ids[1]) + max(common(ids[0], ids[2]), common(ids[1], ids[2]))
    assert want_hits > 600
    for i, q in enumerate(questions):
        assert complete(base, q) == complete(plain, q)
        deadline = time.time() + 30      # inserts run after the prompt: wait for Redis
        while metric(scrape(base), "splitstack_prefix_cache_inserted_tokens_total",
                     tier="redis") < new_block_tokens(ids[:i + 1]) and time.time() < deadline:
            time.sleep(0.2)
    assert metric(scrape(base), "splitstack_prefix_cache_inserted_tokens_total",
                  tier="redis") == new_block_tokens(ids)
    text = scrape(base)
    assert metric(text, "splitstack_prefix_cache_hit_tokens_total") == want_hits
    # cache-aware routing: every prompt went where its prefix already was (memory tier)
    assert metric(text, "splitstack_prefix_cache_hit_tokens_total", tier="memory") == want_hits
    for address in cluster.prefill_addresses:      # both replicas report, each under its name
        assert f'splitstack_prefill_up{{member="{address}"}} 1.0' in text
    assert metric(text, "splitstack_prefix_cache_query_tokens_total") == sum(map(len, ids))
    assert metric(text, "splitstack_prefill_request_seconds_count") == len(ids)
    assert metric(text, "splitstack_prefill_prompt_tokens_total") == sum(map(len, ids))
    no_leaks(ray_session, cluster, prefills=[0, 1])


@pytest.mark.parametrize("extra,param", [
    ({"prefill_mode": "ridgefill"}, "prefill_mode"),     # no maps in this deployment
    ({"replay_ratio": 2.0}, "replay_ratio"),
    # the prompt's log-probs need the attention service's own prefill
    ({"echo": True, "logprobs": 1}, "echo"),
])
def test_prefill_fields_are_checked_by_the_prefill_service(deployment, extra, param):
    base, _ = deployment
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, **extra}
    r = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = httpx.post(base + "/v1/completions", timeout=60,
                    json={"model": MODEL, "prompt": "Hello", "max_tokens": 2,
                          "replay_ratio": 0.05})
    assert ok.status_code == 200


def test_killed_prefill_replica_is_retried_and_its_prefixes_found_in_redis(
        deployment, server, ray_session):
    """Kill the replica that holds the document in memory: the next prompts are retried on
    the other replica, which finds the document's prefix in a cache tier; the pool manager
    takes the dead replica out and places a replacement."""
    base, cluster = deployment
    plain, _ = server
    text = scrape(base)
    held = [metric(text, "splitstack_prefix_cache_hit_tokens_total", tier="memory", member=a)
            for a in cluster.prefill_addresses]
    dead = held.index(max(held))
    dead_address, survivor = cluster.prefill_addresses[dead], cluster.prefills[1 - dead]
    ray_session.kill(cluster.prefills[dead])
    survivor_address = cluster.prefill_addresses[1 - dead]
    found_before = metric(text, "splitstack_prefix_cache_hit_tokens_total",
                          member=survivor_address)
    question = DOCUMENT + "Question: where does the green owl sleep?\nAnswer:"
    prompts = [question] + [f"Write the number {n} in words:" for n in (17, 240, 3)]
    # at once, before the pool manager takes the dead replica out: ties between the two
    # replicas go in turn, so some of these are sent to the dead one and retried
    with ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(lambda p: complete(base, p, 6), prompts))
    assert got == [complete(plain, p, 6) for p in prompts]
    text = scrape(base)
    # down, or already replaced (its series gone): never up
    assert f'splitstack_prefill_up{{member="{dead_address}"}} 1.0' not in text
    assert metric(text, "splitstack_attention_prefill_retries_total") >= 1
    # the survivor served the document's prefix from a cache tier: Redis, where the dead
    # replica wrote it (or its own memory, when the earlier tests prefilled it there too)
    assert metric(text, "splitstack_prefix_cache_hit_tokens_total",
                  member=survivor_address) > found_before + 300
    deadline = time.monotonic() + 60
    while True:
        pools = httpx.get(base + "/admin/pools", timeout=30).json()["data"]
        members = next(p for p in pools if p["pool"] == "prefill")["members"]
        if dead_address not in [m["address"] for m in members] and len(members) == 2:
            break
        assert time.monotonic() < deadline, members
        time.sleep(0.5)
    free, total = ray_session.get(cluster.attention[0].blocks.remote())
    assert free == total
    free, total = ray_session.get(survivor.blocks.remote())
    assert free == total
