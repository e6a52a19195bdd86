"""Runs an `LLMEngine` on its own thread and streams its outputs to asyncio callers.

Contract: the engine thread is the only code that touches the engine. Callers `submit` a
request (validated on the engine thread, so a bad one raises in the caller and costs
nothing) and iterate its `StepOutput`s; `abort` frees the request's KV at the next step
boundary. A failed step fails only the requests in it (see `LLMEngine.step`).
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass

from services.engine import GenerationParams, LLMEngine, StepOutput


@dataclass
class _Submit:
    prompt_ids: list[int]
    params: GenerationParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    done: threading.Event
    seq_id: int | None = None
    error: Exception | None = None


class EngineBackend:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.commands: queue.Queue = queue.Queue()
        self.streams: dict[int, _Submit] = {}
        self.stats = {"steps": 0, "last_step_s": 0.0}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.thread.start()

    # ---- caller side (any thread / event loop) ----------------------------------
    async def submit(self, prompt_ids: list[int], params: GenerationParams) -> tuple[int, asyncio.Queue]:
        sub = _Submit(prompt_ids, params, asyncio.get_running_loop(), asyncio.Queue(),
                      threading.Event())
        self.commands.put(("add", sub))
        await asyncio.get_running_loop().run_in_executor(None, sub.done.wait)
        if sub.error is not None:
            raise sub.error
        return sub.seq_id, sub.out

    def abort(self, seq_id: int) -> None:
        self.commands.put(("abort", seq_id))

    def healthy(self) -> bool:
        return self.thread.is_alive()

    def kv_usage(self) -> float:
        return self.engine.blocks.usage

    def num_running(self) -> int:
        return len(self.streams)

    async def refresh(self) -> None:
        """Nothing to poll: the engine is in this process."""

    def shutdown(self) -> None:
        self._stop.set()
        self.commands.put(("noop", None))
        self.thread.join(timeout=10)

    # ---- engine thread ------------------------------------------------------------
    def _handle(self, kind, arg) -> None:
        if kind == "add":
            try:
                arg.seq_id = self.engine.add_request(arg.prompt_ids, arg.params)
                self.streams[arg.seq_id] = arg
            except Exception as exc:  # RequestError and friends go back to the caller
                arg.error = exc
            arg.done.set()
        elif kind == "abort" and arg in self.streams:
            self.engine.abort(arg)
            self._deliver(StepOutput(arg, None, None, True, "abort"))

    def _deliver(self, out: StepOutput) -> None:
        sub = self.streams.get(out.seq_id)
        if sub is None:
            return
        try:
            sub.loop.call_soon_threadsafe(sub.out.put_nowait, out)
        except RuntimeError:              # the caller's event loop is gone: nobody listens
            if not out.finished:
                self.engine.abort(out.seq_id)
            out = StepOutput(out.seq_id, None, None, True, "abort")
        if out.finished:
            del self.streams[out.seq_id]
            self.engine.pop(out.seq_id)

    def _loop(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished()
            try:
                while True:
                    kind, arg = self.commands.get(block=block, timeout=0.5 if block else None)
                    self._handle(kind, arg)
                    block = False
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            start = time.perf_counter()
            for out in self.engine.step():
                self._deliver(out)
            self.stats["steps"] += 1
            self.stats["last_step_s"] = time.perf_counter() - start
