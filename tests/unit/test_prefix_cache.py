"""Prefix cache memory tier: exact rows, token-level matches, LRU by bytes, pins, provenance."""
from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import CollectorRegistry

from services.prefix_cache import (EXACT, FILLED, PrefixCache, PrefixCacheConfig,
                                   PrefixCacheError, PrefixCacheMetrics)
from services.prefix_cache.block import (Block, CorruptBlock, block_key, decode_block,
                                         encode_block, root_key)

F, KV, D, G, H = 2, 2, 4, 3, 8  # FA layers, kv heads, head dim, groups, hidden
BS = 16


def rows(n: int, seed: int = 0, dtype=torch.float32, hidden: bool = True):
    """kv [F, 2, n, KV, D], hidden [G, n, H] or None, provenance uint8 [n] (all exact)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(F, 2, n, KV, D, generator=g).to(dtype)
    hid = torch.randn(G, n, H, generator=g).to(dtype) if hidden else None
    return kv, hid, torch.zeros(n, dtype=torch.uint8)


def prompt(n: int, seed: int = 0) -> list[int]:
    """Random ids in [1000 seed, 1000 seed + 1000): prompts of different seeds share none."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000 * seed, 1000 * seed + 1000, (n,), generator=g).tolist()


def block_bytes(n: int = BS) -> int:
    kv, hid, prov = rows(n)
    return (kv.numel() + hid.numel()) * 4 + prov.numel()


def make_cache(**kw) -> PrefixCache:
    return PrefixCache(PrefixCacheConfig(namespace="model-a", block_size=BS, **kw),
                       PrefixCacheMetrics(CollectorRegistry()))


def sample(cache: PrefixCache, name: str, **labels) -> float:
    return cache.metrics.registry.get_sample_value(name, labels) or 0.0


def check_invariants(cache: PrefixCache, hits) -> None:
    """Bytes, child counts, parents and pins of the memory tier, recomputed from scratch."""
    blocks = cache._blocks
    assert cache.stats().bytes_used == sum(b.nbytes for b in blocks.values())
    assert cache.stats().bytes_used <= cache.config.capacity_bytes
    for b in blocks.values():
        assert b.parent == cache.root or b.parent in blocks, "orphan block"
        assert b.resident_kids == sum(c.parent == b.key for c in blocks.values())
        assert b.pins == sum(p is b for h in hits for p in h._pinned)
    assert {k for kids in cache._kids.values() for k in kids} == set(blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_insert_then_lookup_returns_identical_rows(dtype):
    cache = make_cache()
    tokens = prompt(50)
    kv, hid, prov = rows(50, dtype=dtype)
    stored = cache.insert(tokens, kv, hid, prov)
    assert (stored.blocks, stored.tokens, stored.skipped) == (4, 50, 0)  # 3 full + 2-token tail
    with cache.lookup(tokens) as hit:
        assert (hit.length, hit.tier) == (50, "memory")
        assert torch.equal(hit.kv(), kv) and torch.equal(hit.hidden(), hid)
        assert torch.equal(hit.provenance(), prov) and hit.kv().dtype == dtype
    assert cache.insert(tokens, kv, hid, prov).blocks == 0
    assert cache.stats().blocks == 4 and cache.stats().pinned_blocks == 0


def test_dense_model_stores_no_hidden():
    cache = make_cache()
    tokens = prompt(20)
    kv, _, prov = rows(20, hidden=False)
    cache.insert(tokens, kv, None, prov)
    with cache.lookup(tokens) as hit:
        assert hit.hidden() is None and torch.equal(hit.kv(), kv)


@pytest.mark.parametrize("shared", [1, 5, 16, 37, 48, 49])
def test_hit_ends_at_the_last_shared_token(shared):
    cache = make_cache()
    a = prompt(50)
    kv, hid, prov = rows(50)
    cache.insert(a, kv, hid, prov)
    b = a[:shared] + prompt(60 - shared, seed=1)
    with cache.lookup(b) as hit:
        assert hit.length == shared
        assert torch.equal(hit.kv(), kv[:, :, :shared])
        assert torch.equal(hit.hidden(), hid[:, :shared])
    assert cache.lookup(prompt(30, seed=2)) is None


def test_longest_sibling_wins():
    cache = make_cache()
    base = prompt(16)
    short, long = base + [7, 8, 9], base + [7, 8, 9, 10, 11] + list(range(100, 111))
    kv_short, hid, prov = rows(19, seed=1)
    cache.insert(short, kv_short, hid, prov)
    kv_long, hid, prov = rows(32, seed=2)
    cache.insert(long, kv_long, hid, prov)  # its first block is already there
    with cache.lookup(base + [7, 8, 9, 10, 99, 99]) as hit:
        assert hit.length == 20
        assert torch.equal(hit.kv(), torch.cat([kv_short[:, :, :16], kv_long[:, :, 16:20]], 2))


@pytest.mark.parametrize("max_len, expected", [(None, 50), (49, 49), (32, 32), (20, 20), (0, None)])
def test_max_len_caps_the_hit(max_len, expected):
    cache = make_cache()
    tokens = prompt(50)
    kv, hid, prov = rows(50)
    cache.insert(tokens, kv, hid, prov)
    hit = cache.lookup(tokens, max_len=max_len)
    if expected is None:
        assert hit is None
        return
    with hit:
        assert hit.length == expected and torch.equal(hit.kv(), kv[:, :, :expected])


def test_keys_chain_namespace_block_size_and_every_earlier_token():
    tokens = prompt(48)

    def keys(namespace="model-a", block_size=BS, toks=tokens):
        parent, out = root_key(namespace), []
        for s in range(0, len(toks), block_size):
            parent = block_key(parent, block_size, toks[s:s + block_size])
            out.append(parent)
        return out

    base = keys()
    assert len(set(base)) == 3 and all(len(k) == 32 for k in base)
    assert not set(base) & set(keys(namespace="model-b"))
    assert not set(base) & set(keys(block_size=8))
    changed = keys(toks=[tokens[0] + 1] + tokens[1:])
    assert all(x != y for x, y in zip(base, changed))


def test_lru_evicts_least_recently_used_leaf_first():
    cache = make_cache(capacity_bytes=3 * block_bytes())
    p, q, r = prompt(32, seed=1), prompt(16, seed=2), prompt(16, seed=3)
    cache.insert(p, *rows(32))
    cache.insert(q, *rows(16))
    cache.insert(r, *rows(16))  # p0 is least recent but has a resident child: p1 goes
    with cache.lookup(p) as hit:
        assert hit.length == 16
    cache.insert(prompt(16, seed=4), *rows(16))  # q is now least recent
    assert cache.lookup(q) is None
    for tokens in (p, r):
        assert cache.lookup(tokens) is not None
    assert sample(cache, "splitstack_prefix_cache_evictions_total") == 2


def test_capacity_holds_under_random_inserts_lookups_and_pins():
    cache = make_cache(capacity_bytes=10 * block_bytes())
    rng = random.Random(0)
    stems = [prompt(40, seed=s) for s in range(4)]
    hits = []
    for step in range(200):
        tokens = rng.choice(stems)[:rng.randint(1, 40)] + prompt(rng.randint(0, 30), seed=step)
        if rng.random() < 0.5:
            cache.insert(tokens, *rows(len(tokens), seed=step))
        else:
            hit = cache.lookup(tokens)
            if hit is not None:
                hits.append(hit)
        if hits and rng.random() < 0.4:
            hits.pop(rng.randrange(len(hits))).release()
        check_invariants(cache, hits)
    for hit in hits:
        hit.release()
    check_invariants(cache, [])
    assert cache.stats().pinned_blocks == 0
    assert sample(cache, "splitstack_prefix_cache_evictions_total") > 0
    assert sample(cache, "splitstack_prefix_cache_memory_bytes") == cache.stats().bytes_used


def test_pinned_blocks_survive_pressure_and_evict_after_release():
    cache = make_cache(capacity_bytes=2 * block_bytes())
    a, b, c, d = (prompt(16, seed=s) for s in range(4))
    kv_a, hid_a, prov_a = rows(16, seed=10)
    cache.insert(a, kv_a, hid_a, prov_a)
    hit_a = cache.lookup(a)
    cache.insert(b, *rows(16))
    cache.insert(c, *rows(16))  # evicts b, not the pinned a
    assert cache.lookup(b) is None
    hit_c = cache.lookup(c)
    stored = cache.insert(d, *rows(16))  # everything resident is pinned
    assert (stored.blocks, stored.skipped) == (0, 16)
    assert sample(cache, "splitstack_prefix_cache_skipped_tokens_total") == 16
    assert cache.stats().pinned_blocks == 2 and cache.lookup(d) is None
    hit_a.release()
    hit_a.release()  # idempotent
    hit_c.release()
    assert cache.insert(d, *rows(16)).blocks == 1  # a is least recent now
    assert cache.lookup(a) is None
    assert torch.equal(hit_a.kv(), kv_a)  # a released hit still reads its rows


def test_filled_rows_end_the_hit_unless_reuse_filled():
    tokens = prompt(50)
    kv, hid, prov = rows(50)
    prov[20] = prov[40] = FILLED
    strict, lenient = make_cache(), make_cache(reuse_filled=True)
    for cache in (strict, lenient):
        cache.insert(tokens, kv, hid, prov, map_id="map-7")
    with strict.lookup(tokens) as hit:
        assert hit.length == 20 and bool((hit.provenance() == EXACT).all())
    with lenient.lookup(tokens) as hit:
        assert hit.length == 50 and torch.equal(hit.provenance(), prov)
        ids = hit.map_ids()
        assert ids[20] == ids[40] == "map-7" and ids.count(None) == 48

    first = make_cache()
    prov0 = torch.zeros(50, dtype=torch.uint8)
    prov0[16] = FILLED
    first.insert(tokens, kv, hid, prov0)
    assert first.lookup(tokens).length == 16
    prov0[0] = FILLED
    other = make_cache()
    other.insert(tokens, kv, hid, prov0)
    assert other.lookup(tokens) is None


def test_metrics_count_tokens():
    cache = make_cache()
    tokens = prompt(50)
    cache.insert(tokens, *rows(50))
    cache.insert(tokens[:40], *rows(40))  # blocks 0-1 exist, the 8-token tail is new
    assert sample(cache, "splitstack_prefix_cache_inserted_tokens_total", tier="memory") == 58
    cache.lookup(tokens, max_len=49).release()
    cache.lookup(tokens[:37] + [5000] * 13).release()
    assert cache.lookup(prompt(10, seed=9)) is None
    assert sample(cache, "splitstack_prefix_cache_query_tokens_total") == 110
    assert sample(cache, "splitstack_prefix_cache_hit_tokens_total", tier="memory") == 49 + 37
    assert sample(cache, "splitstack_prefix_cache_hit_tokens_total", tier="redis") == 0
    assert sample(cache, "splitstack_prefix_cache_memory_bytes") == cache.stats().bytes_used
    assert sample(cache, "splitstack_prefix_cache_memory_capacity_bytes") == 1 << 30


def test_mismatched_rows_raise_with_the_shape():
    cache = make_cache()
    kv, hid, prov = rows(10)
    with pytest.raises(PrefixCacheError) as err:
        cache.insert(prompt(11), kv, None, torch.zeros(11, dtype=torch.uint8))
    assert err.value.shape == (F, 2, 10, KV, D)
    with pytest.raises(PrefixCacheError):
        cache.insert(prompt(10), kv, hid, prov.to(torch.int64))


@pytest.mark.parametrize("hidden", [True, False])
def test_block_encoding_round_trips_and_rejects_damage(hidden):
    tokens = prompt(16)
    kv, hid, prov = rows(16, dtype=torch.bfloat16, hidden=hidden)
    prov[3] = FILLED
    key = block_key(root_key("model-a"), BS, tokens)
    data = encode_block(Block(key, root_key("model-a"), tuple(tokens), kv, hid, prov, "m1"))
    back = decode_block(key, data, BS)
    assert torch.equal(back.kv, kv) and back.map_id == "m1" and back.tokens == tuple(tokens)
    assert (back.hidden is None) != hidden and torch.equal(back.provenance, prov)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    for bad in (bytes(flipped), data[:-1], data[:40], b"", b"not a block" * 10):
        with pytest.raises(CorruptBlock):
            decode_block(key, bad, BS)
    with pytest.raises(CorruptBlock):
        decode_block(block_key(root_key("model-b"), BS, tokens), data, BS)
    with pytest.raises(CorruptBlock):
        decode_block(key, data, 8)
