"""Paged sweeps that read blocks in place (run by run) against their gathering references:
the attention shard's `sweep` and `cpu_flash.run_paged` for decode rows."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import cpu_flash, naive
from services.attention.shard import KVShard, SeqRows, table_runs
from services.engine.block_manager import BlockManager


class Cfg:
    full_attention_layers = [0, 3]
    num_key_value_heads = 2
    head_dim = 16


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def shards_with(lengths: dict[int, int], num_shards: int, block_size: int, step: int):
    """Shards and block tables grown `step` positions at a time by the engine's allocator,
    sequences taking turns, so the tables are fragmented (many runs); K/V are random."""
    shards = [KVShard(Cfg, i, num_shards, 800, block_size, torch.float32)
              for i in range(num_shards)]
    blocks = BlockManager(800, block_size * num_shards)
    tables: dict[int, list[int]] = {seq: [] for seq in lengths}
    for upto in range(step, max(lengths.values()) + step, step):
        for seq, n in lengths.items():
            blocks.grow(tables[seq], min(upto, n))
    gen = torch.Generator().manual_seed(0)
    for s in shards:
        s.kv.copy_(torch.randn(s.kv.shape, generator=gen))
    return shards, tables


def seq_rows(tables, seq_of_row: list[int]) -> list[SeqRows]:
    rows: dict[int, list[int]] = {}
    for r, seq in enumerate(seq_of_row):
        rows.setdefault(seq, []).append(r)
    return [SeqRows(r, tables[seq], table_runs(tables[seq])) for seq, r in rows.items()]


def check_like_reference(shard, layer, seqs, q, limits):
    o, lse = shard.sweep(layer, seqs, q, limits)
    o_ref, lse_ref = shard.sweep_reference(layer, seqs, q, limits)
    seen = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), seen)          # the same rows see no key
    assert torch.isfinite(o).all() and (o[~seen] == 0).all()
    if seen.any():
        assert rel(o[seen], o_ref[seen]) < 1e-5
        assert (lse[seen] - lse_ref[seen]).abs().max().item() < 1e-4


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("step", [1000, 37, 5])             # one run .. over MAX_RUNS runs
def test_shard_decode_sweep_matches_reference(num_shards, step):
    lengths = {0: 63, 1: 500, 2: 7, 3: 1000}
    shards, tables = shards_with(lengths, num_shards, 4, step)
    if step == 5:
        assert max(len(table_runs(t)) for t in tables.values()) > cpu_flash.MAX_RUNS
    q = torch.randn(4, 4, 16, generator=torch.Generator().manual_seed(1))
    for s in shards:
        check_like_reference(s, 3, seq_rows(tables, [0, 1, 2, 3]), q, [63, 500, 7, 1000])


@pytest.mark.parametrize("num_shards", [1, 3])
def test_shard_prompt_sweep_matches_reference(num_shards):
    """Prompt rows (causal: row at p sees positions <= p), several sequences mixed, more
    rows than one masked kernel call takes; early rows of later shards see no key."""
    shards, tables = shards_with({1: 300, 2: 700}, num_shards, 4, 37)
    pos = torch.cat([torch.arange(300), torch.arange(400, 700)])
    q = torch.randn(600, 4, 16, generator=torch.Generator().manual_seed(2))
    for s in shards:
        check_like_reference(s, 0, seq_rows(tables, [1] * 300 + [2] * 300), q,
                             (pos + 1).tolist())


def test_shard_write_lands_where_the_sweep_reads():
    """Rows written at the slots `slots` gives are what a later sweep attends to."""
    shard = KVShard(Cfg, 0, 1, 16, 4, torch.float32)
    table = [7, 3, 9]
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(9, 2, 16, generator=gen), torch.randn(9, 2, 16, generator=gen)
    rows, slots = shard.slots([table] * 9, list(range(9)))
    assert rows == list(range(9)) and slots[:5] == [28, 29, 30, 31, 12]
    shard.write(0, torch.tensor(slots), k, v)
    q = torch.randn(1, 4, 16, generator=gen)
    o, lse = shard.sweep(0, [SeqRows([0], table, table_runs(table))], q, [9])
    o_ref, lse_ref = naive.attention_lse(q[None], k[None], v[None], causal=False)
    assert rel(o, o_ref[0]) < 1e-5 and (lse - lse_ref[0]).abs().max().item() < 1e-4


def test_table_runs_groups_consecutive_block_ids():
    assert table_runs([4, 5, 6, 2, 8, 9]) == [(4, 3), (2, 1), (8, 2)]
    assert table_runs([]) == []


@pytest.mark.parametrize("gather_keys", [0, cpu_flash.GATHER_KEYS])
@pytest.mark.parametrize("step", [100, 3])
def test_run_paged_decode_matches_gathering_reference(step, gather_keys, monkeypatch):
    """Decode rows over a fragmented block table (odd lengths, an empty row) read in place
    (or, for a batch this small, gathered into one call) give the gathering reference's
    (O, lse)."""
    monkeypatch.setattr(cpu_flash, "GATHER_KEYS", gather_keys)
    gen = torch.Generator().manual_seed(4)
    bs, kvh, d = 4, 2, 16
    k_cache = torch.randn(300, bs, kvh, d, generator=gen)
    v_cache = torch.randn(300, bs, kvh, d, generator=gen)
    lens = [63, 1, 250, 0, 17]
    tables: list[list[int]] = [[] for _ in lens]
    free = iter(range(300))
    for upto in range(step, max(lens) + step, step):          # interleaved growth
        for t, n in zip(tables, lens):
            while len(t) * bs < min(upto, n):
                t.append(next(free))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables])
    kv_lens = torch.tensor(lens)
    q = torch.randn(len(lens), 1, 4, d, generator=gen)
    plan = naive.plan_paged(bt, kv_lens, bs, 1)
    o, lse = cpu_flash.run_paged(q, k_cache, v_cache, plan)
    o_ref, lse_ref = naive.run_paged(q, k_cache, v_cache, naive.plan_paged(bt, kv_lens, bs, 1))
    seen = kv_lens > 0
    assert rel(o[seen], o_ref[seen]) < 1e-5
    assert (lse[seen] - lse_ref[seen]).abs().max().item() < 1e-4
    assert (lse[~seen] == float("-inf")).all() and (o[~seen] == 0).all()


def test_block_runs_groups_consecutive_blocks():
    assert cpu_flash.block_runs([7, 8, 9, 3, 12, 13], 90, 16) == [(7, 48), (3, 16), (12, 26)]
    assert cpu_flash.block_runs([5, 6], 16, 16) == [(5, 16)]
    assert cpu_flash.block_runs([], 0, 16) == []
