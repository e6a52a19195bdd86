"""The engine's series (services.engine.metrics): preemptions and tokens per step counted as
the scheduler decided them, read by the collector as Prometheus families."""
from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry

from models import load_model
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.engine.metrics import ITERATION_TOKEN_BUCKETS, EngineCollector, Tally


def samples(registry: CollectorRegistry) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples}


def test_tally_is_a_cumulative_histogram():
    t = Tally((1, 4, 16))
    for v in (1, 2, 4, 5, 100):
        t.observe(v)
    fam = t.family("x", "doc")
    got = {s.labels.get("le"): s.value for s in fam.samples if s.name == "x_bucket"}
    assert got == {"1.0": 1, "4.0": 3, "16.0": 4, "+Inf": 5}
    totals = {s.name: s.value for s in fam.samples if s.name != "x_bucket"}
    assert totals == {"x_count": 5, "x_sum": 112}


def test_preemptions_and_step_tokens_are_what_the_scheduler_scheduled(tiny_checkpoint):
    """Four long requests on 16 blocks of 4 tokens cannot all keep their KV: the newest are
    preempted. The counts equal what the scheduler's outputs held, step by step."""
    path, _ = tiny_checkpoint("llama3")
    engine = LLMEngine(load_model(path), EngineConfig(block_size=4, num_blocks=16,
                                                     max_num_seqs=4))
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    seen = {"preempted": 0, "steps": 0, "tokens": 0}
    schedule = engine.scheduler.schedule

    def counted():
        out = schedule()
        seen["preempted"] += len(out.preempted)
        if not out.empty:
            seen["steps"] += 1
            seen["tokens"] += sum(c.length for c in out.chunks)
        return out

    engine.scheduler.schedule = counted
    gen = torch.Generator().manual_seed(0)
    for n in (9, 10, 11, 12):
        engine.add_request(torch.randint(0, 1000, (n,), generator=gen).tolist(),
                           GenerationParams(max_tokens=20, ignore_eos=True))
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    got = samples(registry)
    assert seen["preempted"] > 0
    assert got[("splitstack_num_preemptions_total", ())] == seen["preempted"]
    assert got[("splitstack_iteration_tokens_count", ())] == seen["steps"]
    assert got[("splitstack_iteration_tokens_sum", ())] == seen["tokens"]
    top = ("splitstack_iteration_tokens_bucket", (("le", "+Inf"),))
    assert got[top] == seen["steps"]
    assert len([k for k in got if k[0] == "splitstack_iteration_tokens_bucket"]) == \
        len(ITERATION_TOKEN_BUCKETS) + 1
    info = [labels for (name, labels), v in got.items()
            if name == "splitstack_cache_config_info" and v == 1]
    assert info == [(("block_size", "4"), ("max_num_seqs", "4"), ("num_blocks", "16"))]
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_prefilling_steps_run_on_the_prefill_threads(tiny_checkpoint):
    """EngineConfig.prefill_threads: a step with at least PREFILL_ROWS prompt rows runs on
    them, a decode step on the process's threads, which are back after each step."""
    from services.engine.engine import PREFILL_ROWS

    path, _ = tiny_checkpoint("llama3")
    engine = LLMEngine(load_model(path), EngineConfig(block_size=4, num_blocks=64,
                                                     max_num_seqs=4, prefill_threads=2))
    seen = []
    execute = engine.runner.execute

    def recorded(out, rows):
        seen.append((sum(c.length for c in out.prefill), torch.get_num_threads()))
        return execute(out, rows)

    engine.runner.execute = recorded
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine.generate([list(range(1, PREFILL_ROWS + 4)), [5, 6, 7]],
                        GenerationParams(max_tokens=3, ignore_eos=True))
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert after == 1
    assert seen[0] == (PREFILL_ROWS + 3 + 3, 2)                  # both prompts: 2 threads
    assert all(threads == 1 for rows, threads in seen[1:] if rows < PREFILL_ROWS)
    assert len(seen) > 1
