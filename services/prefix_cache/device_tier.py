"""The device tier of the prefix cache: memory-tier blocks' FA KV, resident on the GPU.

    Redis  ⊇  memory tier (host)  ⊇  device tier (a slot pool on the device, LRU)

The tier is inclusive: a block has a device copy only while the memory tier holds it, and
the memory tier's eviction discards the copy (`discard`). The device holds one pool
`[slots, F, 2, block_size, KV, D]`, allocated on first use with `capacity_bytes //
slot_bytes` slots, so the bytes bound is exact: a partial block takes a whole slot.

`gather(parts)` assembles a hit's KV on the device, on the caller's current stream:

    resident blocks  ── index_select from the pool ─────────────────────────┐
    missing blocks   ── host rows into one pinned staging buffer ──► one async copy ─┤
                        └─► admitted into free or evicted LRU slots (one scatter)    ├─► kv
    no room (every slot pinned): used for this hit only ─────────────────────────────┘

Pins: a gather pins the slots it reads or fills until its stream work is done, so no other
gather may evict or refill them meanwhile; eviction takes the least recently used unpinned
slot. One lock guards the slot table; callable from any thread (the engine's copy thread,
and the memory tier's `discard` under its own lock, which is always taken first).
On a CPU device the same bookkeeping runs with synchronous copies (the unit tests).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from services.prefix_cache.block import Block


@dataclass(frozen=True)
class DeviceTierStats:
    capacity_bytes: int
    slot_bytes: int        # 0 until the first block fixes the slot shape
    slots: int             # pool size
    used_slots: int        # slots holding a resident block
    free_slots: int        # the rest, except discarded ones a gather still pins
    pinned_slots: int
    hit_blocks: int        # blocks gathered from the pool
    copied_blocks: int     # blocks copied from host memory (admitted or not)
    admitted_blocks: int   # of those, made resident
    evictions: int

    @property
    def bytes_used(self) -> int:
        return self.used_slots * self.slot_bytes


class DeviceTier:
    def __init__(self, capacity_bytes: int, device: str | torch.device, block_size: int):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes, self.block_size = capacity_bytes, block_size
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._lock = threading.Lock()
        self._pool: torch.Tensor | None = None       # [slots, F, 2, bs, KV, D]
        self._slot_of: OrderedDict[str, int] = OrderedDict()   # key -> slot, LRU first
        self._free: list[int] = []
        self._pins: dict[int, int] = {}               # slot -> pins
        self._doomed: set[int] = set()                # discarded while pinned
        self._staging: torch.Tensor | None = None     # pinned host buffer, grown as needed
        self._gathering = threading.Lock()            # one gather at a time (slots, staging)
        self._counts = dict(hit_blocks=0, copied_blocks=0, admitted_blocks=0, evictions=0)

    # ---- the memory tier's side ----------------------------------------------------
    def discard(self, key: str) -> None:
        """The memory tier evicted `key`: its device copy goes (once unpinned)."""
        with self._lock:
            slot = self._slot_of.pop(key, None)
            if slot is None:
                return
            if self._pins.get(slot, 0):
                self._doomed.add(slot)
            else:
                self._free.append(slot)

    def resident(self, key: str) -> bool:
        with self._lock:
            return key in self._slot_of

    def stats(self) -> DeviceTierStats:
        with self._lock:
            slots = 0 if self._pool is None else self._pool.shape[0]
            slot_bytes = (0 if self._pool is None
                          else self._pool[0].numel() * self._pool.element_size())
            return DeviceTierStats(self.capacity_bytes, slot_bytes, slots,
                                   len(self._slot_of), len(self._free),
                                   sum(1 for p in self._pins.values() if p), **self._counts)

    # ---- gather --------------------------------------------------------------------
    def gather(self, parts: list[tuple[Block, int]],
               cacheable: set[str] | None = None) -> torch.Tensor:
        """The hit's rows as kv [F, 2, m, KV, D] on the device (every part but the last is a
        full block, as `PrefixCache.lookup` builds them). Only blocks in `cacheable` (None:
        all) are admitted: the memory tier passes the ones it holds, so the tier stays
        inclusive. Returns once the device work is done."""
        blocks = [b for b, _ in parts]
        m = sum(rows for _, rows in parts)
        self._ensure_pool(blocks[0])
        # gathers run one at a time: a slot admitted by one is filled before another reads it
        with self._gathering:
            with self._lock:
                plan = [self._take(b.key) for b in blocks]          # slot or None per block
                missing = [i for i, (_, hit) in enumerate(plan) if not hit]
                new_slots = self._admit([blocks[i].key for i in missing], cacheable)
            try:
                out = self._assemble(blocks, plan, missing, new_slots)
            finally:
                with self._lock:
                    for slot in [s for s, _ in plan if s is not None] + \
                            [s for s in new_slots if s is not None]:
                        self._unpin(slot)
        f, two, nb, bs = out.shape[1], out.shape[2], out.shape[0], out.shape[3]
        kv = out.permute(1, 2, 0, 3, 4, 5).reshape(f, two, nb * bs, *out.shape[4:])
        return kv[:, :, :m]

    def _ensure_pool(self, block: Block) -> None:
        with self._lock:
            if self._pool is not None:
                return
            f, two, _, kvh, d = block.kv.shape
            shape = (f, two, self.block_size, kvh, d)
            slot_bytes = torch.Size(shape).numel() * block.kv.element_size()
            n = self.capacity_bytes // slot_bytes
            self._pool = torch.empty(n, *shape, dtype=block.kv.dtype, device=self.device)
            self._free = list(range(n - 1, -1, -1))      # pop() hands out slot 0 first

    def _take(self, key: str) -> tuple[int | None, bool]:
        """(slot, True) for a resident block, pinned and made most recent; else (None, False)."""
        slot = self._slot_of.get(key)
        if slot is None:
            return None, False
        self._slot_of.move_to_end(key)
        self._pins[slot] = self._pins.get(slot, 0) + 1
        self._counts["hit_blocks"] += 1
        return slot, True

    def _admit(self, keys: list[str], cacheable: set[str] | None) -> list[int | None]:
        """A pinned slot for each key (a free one, else the LRU unpinned one), None where no
        slot is left or the key is not cacheable: those pass through for this hit only."""
        slots = []
        for key in keys:
            slot = None
            if cacheable is None or key in cacheable:
                slot = self._free.pop() if self._free else self._evict_lru()
            if slot is not None:
                self._slot_of[key] = slot
                self._pins[slot] = self._pins.get(slot, 0) + 1
                self._counts["admitted_blocks"] += 1
            slots.append(slot)
        self._counts["copied_blocks"] += len(keys)
        return slots

    def _evict_lru(self) -> int | None:
        victim = next((k for k, s in self._slot_of.items() if not self._pins.get(s, 0)), None)
        if victim is None:
            return None
        self._counts["evictions"] += 1
        return self._slot_of.pop(victim)

    def _unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if not self._pins[slot]:
            del self._pins[slot]
            if slot in self._doomed:
                self._doomed.discard(slot)
                self._free.append(slot)

    def _assemble(self, blocks, plan, missing, new_slots) -> torch.Tensor:
        """[nb, F, 2, bs, KV, D] on the device: pool rows for resident blocks, copied rows for
        the others (admitted ones scattered into their slots)."""
        pool, nb = self._pool, len(blocks)
        out = torch.empty(nb, *pool.shape[1:], dtype=pool.dtype, device=self.device)
        resident = [(i, s) for i, (s, hit) in enumerate(plan) if hit]
        if resident:
            pos, src = (self._index([x[j] for x in resident]) for j in (0, 1))
            out.index_copy_(0, pos, pool.index_select(0, src))
        if missing:
            fresh = self._upload([blocks[i] for i in missing])       # [nm, F, 2, bs, KV, D]
            out.index_copy_(0, self._index(missing), fresh)
            kept = [(j, s) for j, s in enumerate(new_slots) if s is not None]
            if kept:
                pool.index_copy_(0, self._index([s for _, s in kept]),
                                 fresh.index_select(0, self._index([j for j, _ in kept])))
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()    # then the pins may go
        return out

    def _upload(self, blocks: list[Block]) -> torch.Tensor:
        """Host rows of `blocks`, block-major and padded to full blocks, staged in one
        pinned buffer and copied to the device in one asynchronous copy."""
        shape = (len(blocks), *self._pool.shape[1:])
        numel = torch.Size(shape).numel()
        if self._staging is None or self._staging.numel() < numel:
            self._staging = torch.empty(numel, dtype=self._pool.dtype, pin_memory=self._cuda)
        staging = self._staging[:numel].view(shape)
        for i, b in enumerate(blocks):
            n = b.kv.shape[2]
            staging[i, :, :, :n] = b.kv
            if n < self.block_size:
                staging[i, :, :, n:] = 0
        # the next gather reuses the staging buffer only after this one's stream work is
        # done (`_assemble` synchronizes before the gather lock is let go)
        return staging.to(self.device, non_blocking=True, copy=True)

    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
