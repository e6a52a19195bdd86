"""Prefix cache Redis tier against the real server at 127.0.0.1:6379, and against dead ones."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from services.prefix_cache import PrefixCache
from services.prefix_cache.block import block_key, root_key
from tests.helpers.redis_tier import BS

pytestmark = pytest.mark.slow

F, KV, D, G, H = 2, 2, 4, 3, 8


def rows(n: int, seed: int = 0):
    """kv [F, 2, n, KV, D] bf16, hidden [G, n, H] bf16, provenance uint8 [n] (all exact)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(F, 2, n, KV, D, generator=g).to(torch.bfloat16),
            torch.randn(G, n, H, generator=g).to(torch.bfloat16),
            torch.zeros(n, dtype=torch.uint8))


def prompt(n: int, seed: int = 0) -> list[int]:
    """Random ids in [1000 seed, 1000 seed + 1000): prompts of different seeds share none."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000 * seed, 1000 * seed + 1000, (n,), generator=g).tolist()


def errors(cache: PrefixCache, kind: str) -> float:
    return cache.metrics.registry.get_sample_value(
        "splitstack_prefix_cache_errors_total", {"tier": "redis", "kind": kind}) or 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_second_replica_finds_the_entry_in_redis(make_cache, redis_client):
    tokens = prompt(50)
    kv, hid, prov = rows(50)
    first = make_cache(redis_ttl_s=600)
    assert first.insert(tokens, kv, hid, prov).redis_tokens == 50
    key = f"{make_cache.prefix}:blk:{block_key(first.root, BS, tokens[:16])}"
    assert 0 < redis_client.ttl(key)
    second = make_cache()
    with second.lookup(tokens) as hit:
        assert (hit.length, hit.tier) == (50, "redis")
        assert torch.equal(hit.kv(), kv) and torch.equal(hit.hidden(), hid)
        assert torch.equal(hit.provenance(), prov)
    assert second.stats().blocks == 4  # promoted
    with second.lookup(tokens) as hit:
        assert hit.tier == "memory"
    third = make_cache()
    with third.lookup(tokens[:37] + prompt(20, seed=1)) as hit:  # via the Redis child index
        assert (hit.length, hit.tier) == (37, "redis")
        assert torch.equal(hit.kv(), kv[:, :, :37])
    sample = third.metrics.registry.get_sample_value
    assert sample("splitstack_prefix_cache_hit_tokens_total", {"tier": "redis"}) == 37
    assert first.insert(tokens, kv, hid, prov).redis_tokens == 0
    assert make_cache(namespace="model-b").lookup(tokens) is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_damaged_value_is_a_miss(make_cache, redis_client, damage):
    tokens = prompt(50)
    kv, hid, prov = rows(50)
    writer = make_cache()
    writer.insert(tokens, kv, hid, prov)
    name = f"{make_cache.prefix}:blk:{block_key(root_key('model-a'), BS, tokens[:16])}"
    value = redis_client.get(name)
    if damage == "flip":
        redis_client.setrange(name, len(value) // 2, bytes([value[len(value) // 2] ^ 0xFF]))
    else:
        redis_client.set(name, value[:len(value) // 2] if damage == "truncate" else b"\x00" * 64)
    reader = make_cache()
    assert reader.lookup(tokens) is None
    assert errors(reader, "corrupt") == 1
    writer.insert(tokens, kv, hid, prov)  # the damaged value was dropped, so it is rewritten
    with make_cache().lookup(tokens) as hit:
        assert hit.length == 50 and torch.equal(hit.kv(), kv)


def test_redis_down_degrades_to_memory(make_cache, caplog):
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    with caplog.at_level("WARNING", logger="services.prefix_cache.redis_tier"):
        cache = make_cache(url=url, redis_backoff_s=600)
    said = " ".join(r.getMessage() for r in caplog.records)     # at startup, no password
    assert "does not answer" in said and "hunter2" not in said and ":***@127.0.0.1" in said
    tokens = prompt(50)
    kv, hid, prov = rows(50)
    stored = cache.insert(tokens, kv, hid, prov)
    assert (stored.tokens, stored.redis_tokens) == (50, 0)
    with cache.lookup(tokens) as hit:
        assert hit.length == 50 and hit.tier == "memory" and torch.equal(hit.kv(), kv)
    assert cache.lookup(prompt(20, seed=1)) is None
    assert errors(cache, "unavailable") == 1  # then it backs off

    retrying = make_cache(url=url, redis_backoff_s=0)
    for n in range(1, 4):
        assert retrying.lookup(prompt(20, seed=n)) is None
        assert errors(retrying, "unavailable") >= n


def test_silent_server_times_out_within_a_second(make_cache):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.05)
    stop, held = threading.Event(), []

    def accept_and_ignore():
        deadline = time.monotonic() + 10
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                pass

    thread = threading.Thread(target=accept_and_ignore, daemon=True)
    thread.start()
    try:
        url = f"redis://127.0.0.1:{server.getsockname()[1]}/0"
        cache = make_cache(url=url, redis_timeout_s=0.2)
        tokens = prompt(50)
        start = time.monotonic()
        assert cache.lookup(tokens) is None
        assert time.monotonic() - start < 1.0
        assert errors(cache, "timeout") == 1
        start = time.monotonic()
        assert cache.insert(tokens, *rows(50)).tokens == 50
        assert time.monotonic() - start < 1.0
        with cache.lookup(tokens) as hit:
            assert hit.length == 50 and hit.tier == "memory"
        assert errors(cache, "unavailable") == 0
    finally:
        stop.set()
        thread.join(timeout=2)
        for conn in held:
            conn.close()
        server.close()


def test_damaged_child_index_entries_are_skipped(make_cache, redis_client):
    tokens = prompt(20)
    kv, hid, prov = rows(20)
    make_cache().insert(tokens, kv, hid, prov)
    root = root_key("model-a")
    redis_client.hset(f"{make_cache.prefix}:kids:{root}",
                      mapping={"odd": b"\x01\x02\x03", b"\xff\xfe": b"\x00" * 8})
    reader = make_cache()
    with reader.lookup(tokens[:5] + prompt(10, seed=1)) as hit:
        assert hit.length == 5 and torch.equal(hit.kv(), kv[:, :, :5])
    assert errors(reader, "corrupt") == 2
