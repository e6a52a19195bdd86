"""Runs an `LLMEngine` on its own thread and streams its outputs to asyncio callers.

Contract: the engine thread is the only code that touches the engine. Callers `submit` a
request (validated on the engine thread, so a bad one raises in the caller and costs
nothing) and iterate its `StepOutput`s; `abort` frees the request's KV at the next step
boundary. A failed step fails only the requests in it (see `LLMEngine.step`); an engine
that cannot step fails every request it holds and reports dead (`StepDriver`, fail stop):
`/health` and `/ready` then answer 503, and `splitstack serve` exits non-zero.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from services.common.faults import NO_FAULTS, FaultPlan
from services.common.messages import GenerationParams, StepOutput
from services.engine.driver import StepDriver
from services.engine.engine import LLMEngine
from services.engine.protocol import EngineClient


@dataclass
class _Submit:
    prompt_ids: list[int]
    params: GenerationParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    done: threading.Event
    seq_id: int | None = None
    error: Exception | None = None
    extra: dict = field(default_factory=dict)       # more keyword arguments of add_request


class EngineBackend(StepDriver, EngineClient):
    def __init__(self, engine: LLMEngine, faults: FaultPlan = NO_FAULTS):
        super().__init__(engine, "engine", faults)

    # ---- caller side (any thread / event loop) ----------------------------------
    async def submit(self, prompt_ids: list[int], params: GenerationParams) -> tuple[int, asyncio.Queue]:
        sub = _Submit(prompt_ids, params, asyncio.get_running_loop(), asyncio.Queue(),
                      threading.Event())
        if params.structured is not None:                            # off the step loop
            sub.extra["grammar"] = await sub.loop.run_in_executor(
                None, self.engine.compile_grammar, params)
        self._put(("add", sub))
        await asyncio.get_running_loop().run_in_executor(None, self._wait, sub.done)
        if sub.error is not None:
            raise sub.error
        return sub.seq_id, sub.out

    def healthy(self) -> bool:
        return self.alive

    def dead_since(self) -> float | None:
        return self.dead_at

    def kv_usage(self) -> float:
        return self.engine.blocks.usage

    def num_running(self) -> int:
        return len(self.engine.scheduler.running)     # a list's length: safe to read here

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)     # a deque's length: safe to read here

    async def refresh(self) -> None:
        """Nothing to poll: the engine is in this process."""

    def close(self) -> None:
        self.shutdown()

    # ---- engine thread ------------------------------------------------------------
    def _send(self, sub: _Submit, out: StepOutput) -> StepOutput:
        try:
            sub.loop.call_soon_threadsafe(sub.out.put_nowait, out)
        except RuntimeError:              # the caller's event loop is gone: nobody listens
            if not out.finished:
                self.engine.abort(out.seq_id)
            out = StepOutput(out.seq_id, None, None, True, "abort")
        return out
