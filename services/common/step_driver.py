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

from services.engine import StepOutput


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

    def shutdown(self) -> None:
        self._stop.set()
        self.commands.put(("noop", None))
        self.thread.join(timeout=10)

    # ---- driver thread ------------------------------------------------------------------
    def _send(self, sub, out: StepOutput) -> StepOutput:
        """Hand `out` to the caller of `sub`; returns what was delivered."""
        raise NotImplementedError

    def _handle(self, kind: str, arg) -> None:
        if kind == "add":          # arg: a submission with prompt_ids, params, done, error
            try:
                arg.seq_id = self.engine.add_request(arg.prompt_ids, arg.params)
                self.streams[arg.seq_id] = arg
            except Exception as exc:  # noqa: BLE001 — RequestError and friends: the caller's
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
