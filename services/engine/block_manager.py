"""Paged KV-cache block allocator with reference counts and exact accounting.

Contract:
- A block id is either free (ref count 0, in the free queue exactly once) or used
  (ref count >= 1, not in the free queue). `check()` asserts this invariant.
- `allocate` hands out the most recently freed blocks first (never-used ones in ascending
  order after them), so ids are deterministic and a server keeps reusing the pages it has
  already touched: the KV cache is a lazily backed memory map, and its resident size
  stays at the working set instead of growing to the whole cache.
- Whoever holds a block table owns one reference per block and must `free` it exactly once
  (on finish, abort, failure or preemption). `share` adds references for a second owner
  (prefix sharing); the block returns to the free queue when the last owner frees it.
- Not thread-safe: the engine loop is the only caller.
"""
from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    def __init__(self, needed: int, free: int):
        super().__init__(f"need {needed} KV blocks, only {free} free")
        self.needed, self.free = needed, free


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_queue: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise NoFreeBlocks(n, len(self.free_queue))
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"cannot share free block {b}")
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        freed = []
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                freed.append(b)
        self.free_queue.extendleft(reversed(freed))       # next out, in table order

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks to `block_table` until it can hold `num_tokens` tokens."""
        need = self.blocks_for(num_tokens) - len(block_table)
        if need > 0:
            block_table.extend(self.allocate(need))

    def check(self) -> None:
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue), "a block is queued twice"
        for b, rc in enumerate(self.ref_counts):
            assert rc >= 0, f"block {b} has ref count {rc}"
            assert (rc == 0) == (b in free), f"block {b}: ref count {rc}, free={b in free}"


class SlotPool:
    """Fixed pool of per-sequence state slots (Gated DeltaNet conv + recurrent states)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free_slots: deque[int] = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def allocate(self) -> int:
        if not self.free_slots:
            raise RuntimeError("no free state slot")
        return self.free_slots.popleft()

    def free(self, slot: int) -> None:
        if slot in self.free_slots or not 0 <= slot < self.num_slots:
            raise ValueError(f"invalid or double free of state slot {slot}")
        self.free_slots.append(slot)
