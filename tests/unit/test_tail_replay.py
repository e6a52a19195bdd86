"""Prefix cache in the engine: exact reuse (dense), Tail-Replay (hybrid), bookkeeping, faults."""
from __future__ import annotations

import socket

import pytest
import torch
from prometheus_client import CollectorRegistry

from models import load_model
from models.config import ModelConfig
from models.random_checkpoint import save_random_checkpoint
from services.engine import EngineConfig, GenerationParams, LLMEngine, RequestError
from services.prefix_cache import PrefixCache, PrefixCacheConfig, PrefixCacheMetrics
from services.prefix_cache.replay import (Group, ReplayError, TailReplayConfig, continue_prefill,
                                          groups, hidden_layers, prompt_rows, replay_len,
                                          tail_replay)
from tests.helpers.tail_replay import INTERLEAVED, hit_tokens, prompt

GREEDY = GenerationParams(max_tokens=4, ignore_eos=True, return_logits=True)
ONE = GenerationParams(max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_configs):
    """(family, layer_types or None) -> model; None keeps the tiny config's layout."""
    models = {}

    def get(family: str, layout: tuple[str, ...] | None = None):
        if (family, layout) not in models:
            cfg = dict(tiny_configs[family])
            if layout is not None:
                cfg.update(num_hidden_layers=len(layout), layer_types=list(layout))
            path = tmp_path_factory.mktemp(f"tr-{family}")
            save_random_checkpoint(cfg, path, seed=2, std=0.1)
            models[family, layout] = load_model(path)
        return models[family, layout]

    return get


def make_cache(**kw) -> PrefixCache:
    return PrefixCache(PrefixCacheConfig(namespace="tiny", block_size=16, **kw),
                       PrefixCacheMetrics(CollectorRegistry()))


def logits(seq) -> torch.Tensor:
    return torch.stack(seq.logits)


def assert_all_returned(engine: LLMEngine) -> None:
    engine.prefix.drain()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    engine.blocks.check()
    if engine.slots is not None:
        assert engine.slots.num_free == engine.slots.num_slots
    assert engine.prefix.cache.stats().pinned_blocks == 0
    assert not engine.prefix._looked and not engine.prefix._rows


# ---- groups and replay length ----------------------------------------------------------------
def test_groups_follow_the_layer_layout(tiny_configs):
    cfg = ModelConfig.from_hf(dict(tiny_configs["qwen3_5"], num_hidden_layers=6,
                                   layer_types=list(INTERLEAVED)))
    assert groups(cfg) == [Group(None, (0,)), Group(1, (2, 3)), Group(4, (5,))]
    assert hidden_layers(cfg) == (1, 4)
    stock = ModelConfig.from_hf(tiny_configs["qwen3_next"])          # L L L F
    assert groups(stock) == [Group(None, (0, 1, 2))] and hidden_layers(stock) == ()
    assert groups(ModelConfig.from_hf(tiny_configs["qwen3"])) == []


@pytest.mark.parametrize("m,r,k", [(100, 0.05, 5), (100, 0.1, 10), (101, 0.1, 11), (30, 0.1, 3),
                                   (10, 0.05, 3), (2, 0.05, 2), (100, 1.0, 100), (100, 0.0, 0)])
def test_replay_len_is_ceil_r_m_at_least_the_conv_window(m, r, k):
    assert replay_len(m, r, conv_kernel=4) == k


def test_replay_ratio_is_validated():
    for bad in (-0.1, 1.5, True, "0.1"):
        with pytest.raises(ReplayError):
            TailReplayConfig(bad)
        with pytest.raises(RequestError, match="replay_ratio"):
            GenerationParams(replay_ratio=bad)


# ---- dense: exact reuse --------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_dense_hit_off_a_block_boundary_is_bitwise_a_prefill_chunked_there(family, checkpoint):
    """A hit of m = 37 tokens (blocks of 16: two full blocks and 5 rows of a third) gives
    logits bitwise equal to a no-cache prefill, and the same greedy tokens.

    What is compared, bit for bit: engine A (cache on) first serves P[:m] alone, so the cache
    holds rows [0, m) as a one-chunk prefill of P[:m] computes them; then it serves P, whose
    first chunk starts at m and attends over the restored rows (the runner's paged branch).
    Engine B (no cache) serves P in chunks of m (max_prefill_chunk = m, as engine A): its first
    chunk is that same one-chunk prefill of P[:m] (same rows, same matmul shapes) and every
    later chunk goes through the same paged branch, so all logits and tokens must be equal.
    A prefill of P in one chunk takes the fresh-prompt branch with other matmul shapes, so
    against it the hit agrees to rounding only: checked at 1e-4 with equal tokens.
    """
    model = checkpoint(family)
    P, m = prompt(90), 37
    cfg = EngineConfig(block_size=16, num_blocks=64, max_prefill_chunk=m)
    cache = make_cache()
    engine = LLMEngine(model, cfg, prefix_cache=cache)
    engine.generate([P[:m]], ONE)
    hit = engine.generate([P], GREEDY)[0]
    assert hit_tokens(cache) == m
    chunked = LLMEngine(model, cfg).generate([P], GREEDY)[0]
    assert torch.equal(logits(hit), logits(chunked))
    assert hit.output_ids == chunked.output_ids
    whole = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64)).generate([P], GREEDY)[0]
    assert (logits(hit) - logits(whole)).abs().max() <= 1e-4
    assert hit.output_ids == whole.output_ids
    assert_all_returned(engine)


def test_dense_hit_ends_where_a_longer_cached_prompt_diverges(checkpoint):
    """The cached prompt shares 37 tokens with P and then differs inside a block: the hit
    is exactly those 37 rows, and the engine's stored rows are the reference forward's."""
    model = checkpoint("qwen3")
    P, m = prompt(90), 37
    other = P[:m] + prompt(30, seed=5)
    engine = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64), prefix_cache=make_cache())
    engine.generate([other], ONE)
    engine.prefix.drain()
    with engine.prefix.cache.lookup(other) as stored:
        kv_ref, _ = prompt_rows(model, torch.tensor(other))
        assert stored.length == len(other)
        assert (stored.kv() - kv_ref).abs().max() <= 1e-5
    got = engine.generate([P], GREEDY)[0]
    assert hit_tokens(engine.prefix.cache) == len(other) + m
    ref = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64)).generate([P], GREEDY)[0]
    assert (logits(got) - logits(ref)).abs().max() <= 1e-4
    assert got.output_ids == ref.output_ids
    assert_all_returned(engine)


# ---- hybrid: Tail-Replay -------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("layout", [None, INTERLEAVED], ids=["stock", "interleaved"])
def test_full_replay_matches_no_cache(family, layout, checkpoint):
    """r = 1 replays every cached row from the zero state, which is what prefill does: the
    logits after a hit are a no-cache prefill's to 1e-4, with the same greedy tokens."""
    model = checkpoint(family, layout)
    P, m = prompt(120, seed=1), 77
    engine = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64, max_prefill_chunk=32),
                       prefix_cache=make_cache(), replay_ratio=1.0)
    engine.generate([P[:m]], ONE)
    got = engine.generate([P], GREEDY)[0]
    assert hit_tokens(engine.prefix.cache) == m
    ref = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64)).generate([P], GREEDY)[0]
    assert (logits(got) - logits(ref)).abs().max() <= 1e-4
    assert got.output_ids == ref.output_ids
    assert_all_returned(engine)


def test_stored_hiddens_are_the_fa_outputs_and_ffn_skip_keeps_the_states(checkpoint):
    """The runner's captured hiddens equal the reference forward's group inputs; replay with
    and without the tail-FFN skip leaves identical states; r = 1 rebuilds the prefill's."""
    model = checkpoint("qwen3_5", INTERLEAVED)
    P = prompt(70, seed=2)
    engine = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64, max_prefill_chunk=32),
                       prefix_cache=make_cache())
    sid = engine.add_request(P, ONE)
    engine.step(), engine.step(), engine.step()           # 3 chunks: 32 + 32 + 6
    seq = engine.seqs[sid]
    assert seq.output_ids and not engine.has_unfinished()
    engine.prefix.drain()
    kv_ref, hidden_ref = prompt_rows(model, torch.tensor(P))
    with engine.prefix.cache.lookup(P) as hit:
        assert hit.hidden().shape == (2, 70, 128)
        assert (hit.hidden() - hidden_ref).abs().max() <= 1e-4     # |h| up to ~7
        # fp32 summation order: chunks 2-3 read the paged cache in place (cpu_flash), the
        # reference attends densely; 1.1e-5 measured, the same 1e-4 bound as the hiddens
        assert (hit.kv() - kv_ref).abs().max() <= 1e-4
        tail = torch.tensor(P[40:])
        skip = tail_replay(model, tail, hit.hidden(40), ffn_skip=True)
        full = tail_replay(model, tail, hit.hidden(40), ffn_skip=False)
        assert torch.equal(skip.conv, full.conv) and torch.equal(skip.recurrent, full.recurrent)
        every = tail_replay(model, torch.tensor(P), hit.hidden())
    ref = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64))
    sid = ref.add_request(P, GenerationParams(max_tokens=2, ignore_eos=True))
    ref.step()                                            # the whole prompt: states at row 69
    slot = ref.seqs[sid].state_slot
    assert (every.recurrent - ref.cache.recurrent[:, slot]).abs().max() <= 1e-4
    assert (every.conv - ref.cache.conv[:, slot]).abs().max() <= 1e-4


def test_short_replay_is_close_and_zero_only_is_worse(checkpoint):
    """r = 2% (k = 4 of 200 rows) leaves a small nonzero error; zero-only (r = 0) a larger
    one. The served hit equals the monolithic reference an evaluation arm would run."""
    model = checkpoint("qwen3_5", INTERLEAVED)
    P, m = prompt(240, seed=3), 200
    ref = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64)).generate([P], GREEDY)[0]
    errors = {}
    for r in (0.02, 0.0):
        engine = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64),
                           prefix_cache=make_cache(), replay_ratio=r)
        engine.generate([P[:m]], ONE)
        got = engine.generate([P], GREEDY)[0]
        errors[r] = (logits(got) - logits(ref)).abs().max().item()
        kv, hidden = prompt_rows(model, torch.tensor(P[:m]))
        k = replay_len(m, r, model.config.linear_conv_kernel_dim)
        states = tail_replay(model, torch.tensor(P[m - k:m]), hidden[:, m - k:])
        arm = continue_prefill(model, torch.tensor(P), kv, states)
        assert (arm[-1] - got.logits[0]).abs().max() <= 1e-4
        assert_all_returned(engine)
    assert 1e-5 < errors[0.02] < 0.1
    assert errors[0.0] > 2 * errors[0.02]


def test_overlap_and_ffn_skip_leave_the_logits_unchanged(checkpoint):
    model = checkpoint("qwen3_5", INTERLEAVED)
    P, m = prompt(150, seed=5), 120
    got = []
    for overlap, skip in ((False, False), (False, True), (True, False), (True, True)):
        engine = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64),
                           prefix_cache=make_cache(), replay_ratio=0.1, replay_overlap=overlap,
                           ffn_skip=skip)
        engine.generate([P[:m]], ONE)
        got.append(logits(engine.generate([P], GREEDY)[0]))
        assert hit_tokens(engine.prefix.cache) == m
        assert_all_returned(engine)
    assert all(torch.equal(g, got[0]) for g in got)


def test_request_replay_ratio_overrides_the_engine(checkpoint):
    model = checkpoint("qwen3_next", INTERLEAVED)
    P, m = prompt(120, seed=4), 100
    ref = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64)).generate([P], GREEDY)[0]
    engine = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64),
                       prefix_cache=make_cache(), replay_ratio=0.0)
    engine.generate([P[:m]], ONE)
    exact = GenerationParams(max_tokens=4, ignore_eos=True, return_logits=True, replay_ratio=1.0)
    zero, full = engine.generate([P, P], [GREEDY, exact])
    assert hit_tokens(engine.prefix.cache) == 2 * m
    assert (logits(full) - logits(ref)).abs().max() <= 1e-4
    assert (logits(zero) - logits(ref)).abs().max() > 1e-3


# ---- bookkeeping ---------------------------------------------------------------------------
def test_no_blocks_or_pins_leak_after_hits_aborts_and_failures(checkpoint, monkeypatch):
    model = checkpoint("qwen3_5", INTERLEAVED)
    cache = make_cache()
    engine = LLMEngine(model, EngineConfig(block_size=16, num_blocks=12, max_num_seqs=4,
                                           max_prefill_chunk=64, max_num_batched_tokens=64),
                       prefix_cache=cache)
    P = prompt(60, seed=6)
    engine.generate([P[:40]], ONE)
    assert_all_returned(engine)
    # a hit: blocks for its 40 cached rows and the rest of the prompt are taken at admission
    # (P[:40] held blocks 0..2 and gave them back to the front of the queue)
    sid = engine.add_request(P, GenerationParams(max_tokens=2, ignore_eos=True))
    engine.step()
    assert engine.seqs[sid].block_table == [0, 1, 2, 3] and engine.seqs[sid].num_computed == 60
    while engine.has_unfinished():
        engine.step()
    assert_all_returned(engine)
    # a hit that waits for blocks keeps its pins until aborted
    hog = engine.add_request(prompt(150, seed=7), GenerationParams(max_tokens=30, ignore_eos=True))
    engine.step(), engine.step(), engine.step()
    waiting = engine.add_request(P[:50] + [1], GenerationParams(max_tokens=2, ignore_eos=True))
    engine.step()
    assert engine.seqs[waiting].block_table == [] and engine.prefix._looked[waiting] is not None
    assert cache.stats().pinned_blocks == 4          # 3 full blocks of P and 2 rows of its 4th
    assert engine.abort(waiting) and cache.stats().pinned_blocks == 0
    engine.abort(hog)
    assert_all_returned(engine)
    # a restore that fails fails its request alone; a runner fault fails the whole step
    import services.engine.prefix as prefix_mod

    def broken_replay(*args, **kw):
        raise RuntimeError("injected replay fault")

    monkeypatch.setattr(prefix_mod, "tail_replay", broken_replay)
    bad, other = engine.add_request(P, ONE), engine.add_request(prompt(20, seed=8), ONE)
    outs = engine.step()
    assert {o.seq_id: o.error for o in outs if o.error} == {
        bad: "RuntimeError: injected replay fault"}
    assert engine.seqs[other].finish_reason == "length"
    monkeypatch.undo()
    assert_all_returned(engine)

    def failing_run(out):
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(engine.runner, "run", failing_run)
    doomed = engine.add_request(P, ONE)
    assert engine.step()[0].error == "RuntimeError: injected device fault"
    assert engine.seqs[doomed].finish_reason == "error"
    monkeypatch.undo()
    assert_all_returned(engine)
    assert engine.generate([P], ONE)[0].output_ids      # still serving, still hitting
    assert_all_returned(engine)


def test_ridgefill_prompts_bypass_the_cache(checkpoint):
    from services.common.messages import PrefillRequest
    from services.prefill.service import PrefillService

    model = checkpoint("qwen3")
    cache = make_cache()
    engine = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64),
                       prefill_service=PrefillService(model), prefix_cache=cache)
    P = prompt(50, seed=9)
    engine.generate([P], ONE)                                 # stored
    settings = PrefillRequest("ridgefill", {"split": model.config.num_hidden_layers, "tail": 0})
    seq = engine.generate([P + [3, 4]], GenerationParams(max_tokens=2, prefill=settings))[0]
    engine.prefix.drain()
    assert len(seq.output_ids) == 2
    assert hit_tokens(cache) == 0 and cache.stats().blocks == 4    # no lookup, no insert
    assert_all_returned(engine)


def test_redis_down_requests_still_succeed(checkpoint):
    """Redis at a closed port: every Redis call degrades to a miss, the memory tier still
    serves hits, and no request fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cache = make_cache(redis_url=f"redis://127.0.0.1:{port}/0", redis_timeout_s=0.05,
                       redis_backoff_s=0.0)
    model = checkpoint("qwen3")
    engine = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64), prefix_cache=cache)
    P = prompt(60, seed=10)
    first = engine.generate([P[:40], prompt(30, seed=11)], GREEDY)
    second = engine.generate([P], GREEDY)[0]
    assert all(s.finish_reason == "length" for s in first + [second])
    assert hit_tokens(cache) == 40
    assert (cache.metrics.registry.get_sample_value(
        "splitstack_prefix_cache_errors_total", {"tier": "redis", "kind": "unavailable"}) > 0)
    ref = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64)).generate([P], GREEDY)[0]
    assert second.output_ids == ref.output_ids
    assert_all_returned(engine)


def test_serve_flags_and_refusals(capsys):
    from services.cli import build_parser, main

    args = build_parser().parse_args(["serve", "--prefix-cache", "--prefix-block-size", "32",
                                      "--redis-url", "redis://127.0.0.1:6379/0",
                                      "--reuse-filled", "--replay-ratio", "0.05"])
    assert (args.prefix_cache, args.prefix_block_size, args.reuse_filled,
            args.replay_ratio, args.prefix_cache_bytes) == (True, 32, True, 0.05, 1 << 30)
    assert main(["serve", "--redis-url", "redis://127.0.0.1:6379/0"]) == 2
    assert "need --prefix-cache" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:                           # before loading
        main(["serve", "--prefix-cache", "--replay-ratio", "1.5"])
    assert exc.value.code == 2 and "argument --replay-ratio" in capsys.readouterr().err
