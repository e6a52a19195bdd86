"""Drives an engine's `step()` on its own thread; other threads submit and abort.

Contract: the driver thread is the only code that touches the engine (an `LLMEngine` or an
`AttentionService`: `add_request`, `abort`, `has_unfinished`, `step`, `pop`). A submitted
request is validated on that thread, so a refused one raises in the caller and costs
nothing; `abort` frees a request's KV at the next step boundary. Subclasses say how a
`StepOutput` reaches its caller (`_send`).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from services.engine import GenerationParams, StepOutput


class StepDriver:
    def __init__(self, engine, name: str):
        self.engine = engine
        self.commands: queue.Queue = queue.Queue()
        self.streams: dict = {}              # seq_id -> the caller's submission
        self.stats = {"steps": 0, "last_step_s": 0.0}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def abort(self, seq_id: int) -> None:
        self.commands.put(("abort", seq_id))

    def call(self, fn, timeout: float | None = 60.0):
        """`fn()` on the driver thread between two steps (what must never change mid-step,
        such as the pool replicas a runner calls); blocks until it ran and returns its
        result, or raises its error. Not from the driver thread itself."""
        job = _Call(fn)
        self.commands.put(("call", job))
        if not job.done.wait(timeout):
            raise TimeoutError(f"the step loop did not run the call within {timeout} s")
        if job.error is not None:
            raise job.error
        return job.result

    def shutdown(self) -> None:
        self._stop.set()
        self.commands.put(("noop", None))
        self.thread.join(timeout=10)

    # ---- driver thread ------------------------------------------------------------------
    def _send(self, sub, out: StepOutput) -> StepOutput:
        """Hand `out` to the caller of `sub`; returns what was delivered."""
        raise NotImplementedError

    def _handle(self, kind: str, arg) -> None:
        if kind == "add":   # arg: a submission: prompt_ids, params, extra, done, error
            try:
                arg.seq_id = self.engine.add_request(arg.prompt_ids, arg.params, **arg.extra)
                self.streams[arg.seq_id] = arg
            except Exception as exc:  # noqa: BLE001 — RequestError and friends: the caller's
                arg.error = exc
            arg.done.set()
        elif kind == "call":
            try:
                arg.result = arg.fn()
            except Exception as exc:  # noqa: BLE001 — raised in the caller
                arg.error = exc
            arg.done.set()
        elif kind == "abort" and arg in self.streams:
            self.engine.abort(arg)
            self._deliver(StepOutput(arg, None, None, True, "abort"))

    def _deliver(self, out: StepOutput) -> None:
        sub = self.streams.get(out.seq_id)
        if sub is None:
            return
        out = self._send(sub, out)
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


@dataclass
class _Call:
    fn: object
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: Exception | None = None


@dataclass
class Submission:
    prompt_ids: list[int]
    params: GenerationParams
    extra: dict = field(default_factory=dict)       # more keyword arguments of add_request
    events: queue.Queue = field(default_factory=queue.Queue)
    done: threading.Event = field(default_factory=threading.Event)
    seq_id: int | None = None
    error: Exception | None = None


class QueueDriver(StepDriver):
    """For blocking callers (gRPC handler threads): `submit` waits until the request is
    accepted or refused, then the caller reads its `StepOutput`s from `events`."""

    def submit(self, prompt_ids: list[int], params: GenerationParams, **extra) -> Submission:
        sub = Submission(prompt_ids, params, extra)
        self.commands.put(("add", sub))
        sub.done.wait()
        if sub.error is not None:
            raise sub.error
        return sub

    def _send(self, sub: Submission, out: StepOutput) -> StepOutput:
        sub.events.put(out)
        return out
