"""The engine in its own process (`EngineProcess`): the same tokens as the engine on a
thread, refusals raised in the caller, aborts that free the KV, the engine's metrics on the
gateway's registry, and fail stop when the child's step loop dies or the child is killed."""
from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from kernels.sampling import SamplingParams
from services.common.messages import EngineDeadError, GenerationParams, RequestError
from services.deployment.build import EngineOptions
from services.deployment.server import embedded_engine
from services.engine.process import EngineProcess
from tests.helpers.gateway import ZOO

PROMPT = [1, 504, 3458, 282, 4649, 314, 216, 5, 22, 11, 198]


def greedy(n: int, **kw) -> GenerationParams:
    return GenerationParams(max_tokens=n, sampling=SamplingParams(temperature=0.0),
                            ignore_eos=True, **kw)


def factory(**options):
    return functools.partial(embedded_engine, ZOO, torch.float32,
                             EngineOptions(kv_cache_bytes=32 << 20, **options), 1)


async def drain(queue: asyncio.Queue) -> list:
    outs = []
    while not outs or not outs[-1].finished:
        outs.append(await asyncio.wait_for(queue.get(), 60))
    return outs


@pytest.fixture(scope="module")
def engine():
    registry = CollectorRegistry()
    proc = EngineProcess(factory(prefix_cache_bytes=1 << 20), registry)
    yield proc, registry
    proc.close()
    assert proc.proc.returncode == 0


def test_same_greedy_tokens_as_the_engine_in_this_process(engine):
    proc, _ = engine
    local, _ = factory()()
    want = local.generate([PROMPT], greedy(12))[0].output_ids

    async def run():
        seq_id, queue = await proc.submit(PROMPT, greedy(12))
        return await drain(queue)

    outs = asyncio.run(run())
    assert [o.token for o in outs] == want
    assert outs[-1].finish_reason == "length" and proc.max_model_len == local.max_model_len


def test_concurrent_requests_stream_from_one_process(engine):
    proc, _ = engine

    async def run():
        subs = [await proc.submit(PROMPT[:k], greedy(6)) for k in (3, 5, 7, 9)]
        return await asyncio.gather(*(drain(q) for _, q in subs)), [s for s, _ in subs]

    results, ids = asyncio.run(run())
    assert len(set(ids)) == 4
    assert all(len(outs) == 6 and outs[-1].finished for outs in results)
    assert proc.open_requests() == 0 and proc.num_running() == 0


def test_a_refused_request_raises_in_the_caller_and_holds_nothing(engine):
    proc, _ = engine

    async def run():
        with pytest.raises(RequestError) as refused:
            await proc.submit([], greedy(4))
        return refused.value

    refused = asyncio.run(run())
    assert refused.field == "prompt" and "at least one token" in str(refused)
    assert proc.open_requests() == 0 and proc.healthy()


def test_abort_frees_the_kv_and_finishes_the_stream(engine):
    proc, _ = engine

    async def run():
        seq_id, queue = await proc.submit(PROMPT * 4, greedy(400))
        first = await asyncio.wait_for(queue.get(), 60)
        busy, running = proc.kv_usage(), proc.num_running()
        proc.abort(seq_id)
        outs = [first] + await drain(queue)
        await asyncio.sleep(0.2)       # a step boundary: the load reported after the abort
        return busy, running, outs

    busy, running, outs = asyncio.run(run())
    assert busy > 0 and running == 1           # scheduled: vLLM's num_requests_running
    assert outs[-1].finish_reason == "abort" and len(outs) < 400
    assert proc.open_requests() == 0
    deadline = time.monotonic() + 10
    while proc.kv_usage() != 0.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.kv_usage() == 0.0


def test_the_engines_metrics_reach_the_gateways_registry(engine):
    proc, registry = engine
    asyncio.run(proc.refresh())
    text = generate_latest(registry).decode()
    assert "splitstack_prefix_cache" in text       # registered in the child only


def test_the_child_gets_no_sigint_and_exits_when_its_parent_is_gone(tmp_path):
    """A parent killed outright leaves no engine behind: the child reads end of file."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import functools, os, sys, torch
        sys.path.insert(0, {str(ZOO.parents[2])!r})
        from services.deployment.build import EngineOptions
        from services.deployment.server import embedded_engine
        from services.engine.process import EngineProcess
        proc = EngineProcess(functools.partial(embedded_engine, {str(ZOO)!r}, torch.float32,
                                               EngineOptions(kv_cache_bytes=32 << 20), 1))
        print(proc.proc.pid, flush=True)
        os.kill(proc.proc.pid, {int(signal.SIGINT)})
        os._exit(0)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=180, cwd=ZOO.parents[2])
    assert out.returncode == 0, out.stderr
    child = int(out.stdout.split()[0])
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_fail_stop_when_the_childs_step_loop_dies(monkeypatch):
    monkeypatch.setenv("SPLITSTACK_FAULT_INJECT", "engine_step:3")     # read by the child
    proc = EngineProcess(factory())

    async def run():
        seq_id, queue = await proc.submit(PROMPT, greedy(50))
        outs = await drain(queue)
        with pytest.raises(EngineDeadError):
            await proc.submit(PROMPT, greedy(4))
        return outs

    try:
        outs = asyncio.run(run())
        assert outs[-1].finish_reason == "error" and "injected" in outs[-1].error
        assert proc.dead_since() is not None and not proc.healthy()
        assert proc.proc.wait(30) == 3
    finally:
        proc.close()


def test_fail_stop_when_the_child_is_killed():
    proc = EngineProcess(factory())

    async def run():
        seq_id, queue = await proc.submit(PROMPT * 4, greedy(400))
        await asyncio.wait_for(queue.get(), 60)
        os.kill(proc.proc.pid, signal.SIGKILL)
        return await drain(queue)

    try:
        outs = asyncio.run(run())
        assert outs[-1].finish_reason == "error" and "code -9" in outs[-1].error
        assert proc.dead_since() is not None and proc.open_requests() == 0
    finally:
        proc.close()
