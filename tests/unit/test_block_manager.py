"""Block accounting with exact ids."""
from __future__ import annotations

import pytest

from services.engine.block_manager import BlockManager, NoFreeBlocks, SlotPool


def test_allocate_and_free_exact_ids():
    bm = BlockManager(6, 4)
    a = bm.allocate(2)
    b = bm.allocate(3)
    assert a == [0, 1] and b == [2, 3, 4]
    bm.free(a)
    assert list(bm.free_queue) == [0, 1, 5]        # the freed (warm) blocks go out first
    assert bm.allocate(2) == [0, 1]
    bm.check()


def test_shared_block_returns_after_last_owner():
    bm = BlockManager(3, 4)
    blocks = bm.allocate(2)
    bm.share(blocks)
    bm.free(blocks)
    assert bm.num_free == 1 and bm.ref_counts[:2] == [1, 1]
    bm.free(blocks)
    assert bm.num_free == 3 and list(bm.free_queue) == [0, 1, 2]
    bm.check()


def test_double_free_and_exhaustion_raise():
    bm = BlockManager(2, 4)
    blocks = bm.allocate(2)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(1)
    bm.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        bm.free(blocks[:1])


def test_grow_appends_only_needed_blocks():
    bm = BlockManager(8, 4)
    table: list[int] = []
    bm.grow(table, 5)
    assert table == [0, 1]
    bm.grow(table, 8)
    assert table == [0, 1]
    bm.grow(table, 9)
    assert table == [0, 1, 2]


def test_slot_pool():
    pool = SlotPool(2)
    assert pool.allocate() == 0 and pool.allocate() == 1
    with pytest.raises(RuntimeError):
        pool.allocate()
    pool.free(0)
    with pytest.raises(ValueError):
        pool.free(0)
