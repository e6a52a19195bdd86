"""Fail stop: `SPLITSTACK_FAULT_INJECT` parsing, and a step loop that dies failing every
request it holds, freeing their KV, refusing what comes after, and reporting dead."""
from __future__ import annotations

import asyncio

import pytest
import torch

from models import load_model
from services.common.faults import ENV, FaultPlan, InjectedFault
from services.common.messages import EngineDeadError
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.engine.driver import QueueDriver
from services.engine.backend import EngineBackend


# ---- the setting --------------------------------------------------------------------------
def test_plan_keeps_unscoped_entries_and_those_scoped_to_the_member():
    spec = "engine_step:40, pool_call:7@pool-1,prefill:3@prefill-0"
    assert FaultPlan.parse(spec).at == {"engine_step": 40}
    assert FaultPlan.parse(spec, "pool-1").at == {"engine_step": 40, "pool_call": 7}
    assert FaultPlan.parse(spec, "prefill-0").at == {"engine_step": 40, "prefill": 3}
    assert not FaultPlan.parse("") and not FaultPlan.parse(None)


@pytest.mark.parametrize("spec, says", [
    ("engine_stp:4", "unknown point 'engine_stp'"),
    ("engine_step", "needs POINT:N"),
    ("engine_step:0", "needs POINT:N"),
    ("engine_step:-2", "needs POINT:N"),
    ("pool_call:3@", "names no member"),
])
def test_malformed_entries_are_refused_naming_them(spec, says):
    with pytest.raises(ValueError, match=says) as err:
        FaultPlan.parse(spec)
    assert ENV in str(err.value)


def test_plan_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV, "engine_step:5@attention-1")
    assert FaultPlan.from_env("attention-1").at == {"engine_step": 5}
    assert FaultPlan.from_env("attention-0").at == {}
    monkeypatch.delenv(ENV)
    assert FaultPlan.from_env().at == {}


def test_a_point_raises_on_its_nth_pass_only():
    point = FaultPlan.parse("pool_call:3").point("pool_call")
    point.hit()
    point.hit()
    with pytest.raises(InjectedFault, match="pool_call pass 3"):
        point.hit()
    for _ in range(5):                    # once: the process is failing stop by then
        point.hit()
    unarmed = FaultPlan().point("engine_step")
    for _ in range(100):
        unarmed.hit()


# ---- the step loop ------------------------------------------------------------------------
@pytest.fixture
def engine(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama3")
    return LLMEngine(load_model(path), EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4))


def prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 1000, (7 + i,), generator=gen).tolist() for i in range(n)]


LONG = GenerationParams(max_tokens=200, ignore_eos=True)


def test_a_dead_step_loop_fails_every_request_frees_its_kv_and_refuses_new_ones(engine):
    died = []
    loop = QueueDriver(engine, "steps", FaultPlan.parse("engine_step:6"), on_dead=died.append)
    subs = [loop.submit(p, LONG) for p in prompts(3)]
    ends = []
    for sub in subs:
        tokens = 0
        while True:
            out = sub.events.get(timeout=60)
            if isinstance(out, EngineDeadError):
                ends.append(out)
                break
            assert out.error is None and not out.finished
            tokens += 1
        assert 0 < tokens < LONG.max_tokens      # it died mid-stream
    assert all(e is loop.dead for e in ends) and "InjectedFault" in str(loop.dead)
    assert died == [loop.dead]                   # on_dead ran once, after every caller knew
    loop.thread.join(10)
    assert not loop.thread.is_alive() and not loop.alive and loop.dead_at is not None
    assert engine.blocks.num_free == engine.blocks.num_blocks
    engine.blocks.check()
    assert loop.streams == {}
    with pytest.raises(EngineDeadError):
        loop.submit(prompts(1)[0], LONG)
    with pytest.raises(EngineDeadError):
        loop.call(lambda: 1)


def test_a_failure_outside_the_runner_kills_the_loop_too(engine, monkeypatch):
    """Not only injected faults: whatever escapes `engine.step` (here the scheduler)."""
    loop = QueueDriver(engine, "steps")
    sub = loop.submit(prompts(1)[0], LONG)
    assert not isinstance(sub.events.get(timeout=60), EngineDeadError)

    def broken():
        raise KeyError("a block table out of step")

    monkeypatch.setattr(engine.scheduler, "schedule", broken)
    while not isinstance(out := sub.events.get(timeout=60), EngineDeadError):
        assert out.error is None
    assert "KeyError" in str(out)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_commands_queued_at_the_death_are_answered(engine):
    """A submit queued behind the fatal command is refused, not left waiting."""
    loop = QueueDriver(engine, "steps")
    assert loop.call(lambda: 7) == 7
    loop.kill(RuntimeError("boom"))
    with pytest.raises(EngineDeadError, match="RuntimeError: boom"):
        loop.submit(prompts(1)[0], LONG)
    loop.thread.join(10)
    assert not loop.thread.is_alive()


def test_embedded_backend_fails_streams_with_an_error_output_and_reports_dead(engine):
    # late enough that all four are in flight however the steps and the submits interleave
    backend = EngineBackend(engine, FaultPlan.parse("engine_step:40"))

    async def run():
        queues = [q for _, q in await asyncio.gather(*(backend.submit(p, LONG)
                                                        for p in prompts(4)))]
        ends = []
        for q in queues:
            while not (out := await asyncio.wait_for(q.get(), 60)).finished:
                assert out.token is not None
            ends.append(out)
        return ends

    ends = asyncio.run(run())
    assert [(o.finish_reason, "the engine stopped: InjectedFault" in o.error) for o in ends] \
        == [("error", True)] * 4
    assert not backend.healthy() and backend.dead_since() is not None
    assert engine.blocks.num_free == engine.blocks.num_blocks

    async def again():
        await backend.submit(prompts(1)[0], LONG)

    with pytest.raises(EngineDeadError):
        asyncio.run(again())


def test_the_suite_has_a_per_test_timeout(pytestconfig):
    """pytest-timeout is configured (pyproject), so a hung test fails instead of CI."""
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert 0 < float(pytestconfig.getini("timeout")) <= 900


def test_embedded_backend_reports_scheduled_and_waiting_requests(engine):
    """`num_running` is what the scheduler runs (vLLM's `num_requests_running`), not what
    was submitted: past `max_num_seqs` (4) the rest wait."""
    backend = EngineBackend(engine)

    async def run():
        subs = [await backend.submit(p, LONG) for p in prompts(6)]
        for _, q in subs[:4]:
            await asyncio.wait_for(q.get(), 60)
        loaded = backend.num_running(), backend.num_waiting()
        for seq_id, _ in subs:
            backend.abort(seq_id)
        for _, q in subs:
            while not (await asyncio.wait_for(q.get(), 60)).finished:
                pass
        return loaded

    try:
        assert asyncio.run(run()) == (4, 2)
        assert (backend.num_running(), backend.num_waiting()) == (0, 0)
        assert engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        backend.close()
