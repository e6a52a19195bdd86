"""Token-level prefix cache of Tail-Replay: FA KV, FA output hiddens and provenance per token.

A lookup follows full blocks by key (`block.py`). At the first miss it takes, among the
children of the last matched block, the one sharing the longest token prefix with the query
and uses that many of its rows, so a hit may end at any token.

Tiers: an LRU memory tier bounded in payload bytes, an optional Redis tier that replicas
share (`redis_tier.py`), and above memory an optional device tier that keeps blocks' FA KV on
the GPU (`device_tier.py`, inclusive of memory). Redis hits are promoted into memory, and a
hit's KV gathered on the device (`Hit.kv_to`) promotes its blocks into the device tier.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.prefix_cache.block import (Block, block_key, check_rows, common_prefix, copy_rows,
                                         root_key)
from services.prefix_cache.config import PrefixCacheConfig
from services.prefix_cache.device_tier import DeviceTier
from services.prefix_cache.metrics import PrefixCacheMetrics
from services.prefix_cache.redis_tier import RedisTier


@dataclass(frozen=True)
class Inserted:
    blocks: int        # blocks new to the memory tier
    tokens: int        # their rows
    skipped: int       # rows not stored in memory: no room beside pinned blocks
    redis_tokens: int  # rows newly written to Redis


@dataclass(frozen=True)
class CacheStats:
    bytes_used: int
    capacity_bytes: int
    blocks: int
    pinned_blocks: int


class Hit:
    """The first `length` tokens of a query, as rows of cached blocks in order.

    Owns one pin on each memory-tier block it uses, so none of them is evicted until
    `release()` (or the end of its `with` block). Release every hit; a second call is a no-op.
    """

    def __init__(self, cache: PrefixCache, parts: list[tuple[Block, int]], pinned: list[Block],
                 tier: str):
        self._cache, self._parts, self._pinned = cache, parts, pinned
        self.length = sum(rows for _, rows in parts)
        self.tier = tier  # "redis" when any block came from Redis, else "memory"

    def kv(self) -> torch.Tensor:
        """[F, 2, m, KV, D]"""
        return torch.cat([b.kv[:, :, :rows] for b, rows in self._parts], dim=2)

    def hidden(self, start: int = 0) -> torch.Tensor | None:
        """[G, m − start, H]: rows [start, m), or None when the blocks carry no hiddens
        (dense models). A replay reads only its tail, so only the tail is copied."""
        if any(b.hidden is None for b, _ in self._parts):
            return None
        pieces, first = [], 0
        for b, rows in self._parts:
            lo = max(0, start - first)
            if lo < rows:
                pieces.append(b.hidden[:, lo:rows])
            first += rows
        if not pieces:
            return self._parts[0][0].hidden[:, :0].clone()
        return torch.cat(pieces, dim=1)

    def kv_to(self, device: str | torch.device) -> torch.Tensor:
        """[F, 2, m, KV, D] on `device`: through the device tier when it serves that device
        (resident blocks read in place, the others copied from pinned staging and
        admitted), else a copy of `kv()`."""
        tier, device = self._cache.device_tier, torch.device(device)
        if tier is not None and (tier.device.type, tier.device.index or 0) == \
                (device.type, device.index or 0):
            kv = tier.gather(self._parts, {b.key for b in self._pinned})
            self._cache.metrics.device_bytes.set(tier.stats().bytes_used)
            return kv
        return self.kv().to(device, non_blocking=True)

    def provenance(self) -> torch.Tensor:
        """uint8 [m]: EXACT or FILLED per row."""
        return torch.cat([b.provenance[:rows] for b, rows in self._parts])

    def map_ids(self) -> list[str | None]:
        """[m]: the map id of each filled row, None for exact rows."""
        return [b.map_id if filled else None
                for b, rows in self._parts for filled in b.provenance[:rows].tolist()]

    def release(self) -> None:
        pinned, self._pinned = self._pinned, []
        self._cache._unpin(pinned)

    def __enter__(self) -> Hit:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class PrefixCache:
    """Token-level prefix cache: an LRU memory tier, and Redis behind it when configured.

    Every method may be called from any thread: one lock guards the memory tier (LRU order,
    pins, child index) and Redis I/O runs outside it. No method raises on a Redis failure.
    Eviction takes the least recently used block that is unpinned and has no resident
    children, so prefixes shrink from their tail and a resident block's parent is resident.
    """

    def __init__(self, config: PrefixCacheConfig, metrics: PrefixCacheMetrics | None = None,
                 device: str | torch.device | None = None):
        """`device`: where hits are restored to; with `config.device_capacity_bytes` it
        gets a device tier (a CPU device runs the tier's bookkeeping, for tests)."""
        self.config = config
        self.metrics = metrics or PrefixCacheMetrics()
        self.root = root_key(config.namespace)
        self._blocks: OrderedDict[str, Block] = OrderedDict()  # least recently used first
        self._kids: dict[str, dict[str, tuple[int, ...]]] = {}  # parent -> resident children
        self._bytes = 0
        self._lock = threading.Lock()
        self._redis = RedisTier(config, self.metrics) if config.redis_url else None
        self.device_tier = (DeviceTier(config.device_capacity_bytes, device, config.block_size)
                            if device is not None and config.device_capacity_bytes else None)
        self.metrics.memory_capacity_bytes.set(config.capacity_bytes)

    def insert(self, tokens: Sequence[int], kv: torch.Tensor, hidden: torch.Tensor | None,
               provenance: torch.Tensor, map_id: str | None = None) -> Inserted:
        """Store a prompt: kv [F, 2, N, KV, D], hidden [G, N, H] or None, provenance uint8 [N].

        Blocks already resident are only touched. A block that finds no room beside pinned
        blocks is skipped in memory, and so are the blocks after it; Redis gets them all.
        """
        tokens = [int(t) for t in tokens]
        check_rows(len(tokens), kv, hidden, provenance)
        bs = self.config.block_size
        chain, pinned, parent = [], [], self.root
        new_blocks = new_tokens = skipped = 0
        try:
            for start in range(0, len(tokens), bs):
                end = min(start + bs, len(tokens))
                key = block_key(parent, bs, tokens[start:end])
                resident = block = self._acquire(key)
                if resident is None:
                    block = Block(key, parent, tuple(tokens[start:end]),
                                  copy_rows(kv, 2, start, end),
                                  None if hidden is None else copy_rows(hidden, 1, start, end),
                                  copy_rows(provenance, 0, start, end), map_id)
                    resident = self._admit(block)
                    if resident is block:
                        new_blocks, new_tokens = new_blocks + 1, new_tokens + end - start
                    elif resident is None:
                        skipped += end - start
                if resident is not None:
                    pinned.append(resident)
                chain.append(resident or block)
                parent = key
        finally:
            self._unpin(pinned)
        redis_tokens = self._redis.put(chain) if self._redis is not None else 0
        self.metrics.inserted_tokens.labels(tier="memory").inc(new_tokens)
        self.metrics.inserted_tokens.labels(tier="redis").inc(redis_tokens)
        self.metrics.skipped_tokens.inc(skipped)
        return Inserted(new_blocks, new_tokens, skipped, redis_tokens)

    def lookup(self, tokens: Sequence[int], max_len: int | None = None) -> Hit | None:
        """The longest cached prefix of `tokens`, at most `max_len` tokens; None when empty.

        Callers pass `max_len=len(tokens) - 1` to keep one token to compute.
        """
        tokens = [int(t) for t in tokens]
        limit = len(tokens) if max_len is None else max(0, min(len(tokens), max_len))
        bs, reuse_filled = self.config.block_size, self.config.reuse_filled
        parts, pinned, tier_rows = [], [], {"memory": 0, "redis": 0}
        parent, m = self.root, 0
        while m < limit:
            chunk = tokens[m:m + bs]
            found = (self._fetch(block_key(parent, bs, chunk), pinned)
                     or self._best_child(parent, chunk, pinned))
            if found is None:
                break
            block, tier = found
            rows = min(common_prefix(block.tokens, chunk), limit - m,
                       block.reusable_rows(reuse_filled))
            if rows == 0:
                break
            parts.append((block, rows))
            tier_rows[tier] += rows
            m += rows
            if rows < bs:
                break
            parent = block.key
        self.metrics.query_tokens.inc(len(tokens))
        for tier, rows in tier_rows.items():
            self.metrics.hit_tokens.labels(tier=tier).inc(rows)
        if not parts:
            self._unpin(pinned)
            return None
        return Hit(self, parts, pinned, "redis" if tier_rows["redis"] else "memory")

    def resident_tokens(self, tokens: Sequence[int]) -> int:
        """Leading tokens of `tokens` whose full blocks sit in the memory tier: a probe for
        routing (no pins, no LRU touch, no Redis, no metrics)."""
        bs, n = self.config.block_size, len(tokens)
        parent, m = self.root, 0
        with self._lock:
            while m + bs <= n:
                key = block_key(parent, bs, [int(t) for t in tokens[m:m + bs]])
                if key not in self._blocks:
                    break
                parent, m = key, m + bs
        return m

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._bytes, self.config.capacity_bytes, len(self._blocks),
                              sum(b.pins > 0 for b in self._blocks.values()))

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()

    def _fetch(self, key: str, pinned: list[Block]) -> tuple[Block, str] | None:
        """The block `key` from memory, else from Redis (promoted); appends what it pins."""
        block = self._acquire(key)
        if block is not None:
            pinned.append(block)
            return block, "memory"
        block = self._redis.get(key) if self._redis is not None else None
        if block is None:
            return None
        resident = self._admit(block)
        if resident is not None:
            pinned.append(resident)
        return resident or block, "redis"

    def _best_child(self, parent: str, chunk: list[int],
                    pinned: list[Block]) -> tuple[Block, str] | None:
        """The child of `parent` sharing the longest (>= 1) token prefix with `chunk`."""
        with self._lock:
            kids = dict(self._kids.get(parent, {}))
        if self._redis is not None:
            for key, tokens in self._redis.kids(parent).items():
                kids.setdefault(key, tokens)
        ranked = sorted(((common_prefix(t, chunk), k) for k, t in kids.items()), reverse=True)
        for shared, key in ranked:
            if shared == 0:
                break
            found = self._fetch(key, pinned)
            if found is not None:
                return found
        return None

    def _acquire(self, key: str) -> Block | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                block.pins += 1
                self._blocks.move_to_end(key)
            return block

    def _admit(self, block: Block) -> Block | None:
        """Make `block` resident and pin it; None when its parent is not resident or no room
        is left beside pinned blocks. Returns the resident block (another thread's if raced).
        The caller holds a pin on the parent, so making room never evicts it."""
        with self._lock:
            resident = self._blocks.get(block.key)
            if resident is None:
                parent = self._blocks.get(block.parent)
                if parent is None and block.parent != self.root:
                    return None
                if not self._make_room(block.nbytes):
                    return None
                self._blocks[block.key] = resident = block
                self._bytes += block.nbytes
                self._kids.setdefault(block.parent, {})[block.key] = block.tokens
                if parent is not None:
                    parent.resident_kids += 1
                self.metrics.memory_bytes.set(self._bytes)
            else:
                self._blocks.move_to_end(block.key)
            resident.pins += 1
            return resident

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.config.capacity_bytes:
            return False
        while self._bytes + nbytes > self.config.capacity_bytes:
            victim = next((b for b in self._blocks.values()
                           if b.pins == 0 and b.resident_kids == 0), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, block: Block) -> None:
        del self._blocks[block.key]
        self._bytes -= block.nbytes
        siblings = self._kids[block.parent]
        del siblings[block.key]
        if not siblings:
            del self._kids[block.parent]
        parent = self._blocks.get(block.parent)
        if parent is not None:
            parent.resident_kids -= 1
        if self.device_tier is not None:        # inclusive: no device copy without a host one
            self.device_tier.discard(block.key)
        self.metrics.evictions.inc()
        self.metrics.memory_bytes.set(self._bytes)

    def _unpin(self, blocks: list[Block]) -> None:
        with self._lock:
            for block in blocks:
                block.pins -= 1
