"""Drives an engine's `step()` on its own thread; other threads submit and abort.

Contract: the driver thread is the only code that touches the engine (an `LLMEngine`:
`add_request`, `abort`, `has_work`, `step`, `pop`). A submitted request is validated
on that thread, so a refused one raises in the caller and costs nothing; `abort` frees a
request's KV at the next step boundary. Subclasses say how a `StepOutput` reaches its
caller (`_send`) and how a caller learns the engine died (`_send_dead`).

Fail stop: a failure inside the runner fails only the requests of that step
(`LLMEngine.step`); anything else the loop raises (the scheduler, the bookkeeping, an
injected `engine_step` fault) kills the engine. The driver then aborts every request it
holds (freeing its KV), tells each caller (`_send_dead`), refuses what is queued and what
comes later with `EngineDeadError`, sets `dead`, and calls `on_dead` once: the process's
owner exits so the orchestrator restarts it.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from services.common.faults import NO_FAULTS, FaultPlan
from services.common.messages import EngineDeadError
from services.common.messages import GenerationParams, StepOutput

log = logging.getLogger(__name__)


class StepDriver:
    def __init__(self, engine, name: str, faults: FaultPlan = NO_FAULTS,
                 on_dead: Callable[[EngineDeadError], None] | None = None):
        """`faults`: this process's injected faults (`engine_step`); `on_dead`: called once
        on the driver thread after the engine died and every caller was told."""
        self.engine = engine
        self.commands: queue.Queue = queue.Queue()
        self.streams: dict = {}              # seq_id -> the caller's submission
        self.stats = {"steps": 0, "last_step_s": 0.0}
        self.dead: EngineDeadError | None = None
        self.dead_at: float | None = None    # monotonic time of the death
        self.on_dead = on_dead
        self._fault = faults.point("engine_step")
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.dead is None and self.thread.is_alive()

    def abort(self, seq_id: int) -> None:
        self.commands.put(("abort", seq_id))

    def call(self, fn, timeout: float | None = 60.0):
        """`fn()` on the driver thread between two steps (what must never change mid-step,
        such as the pool replicas a runner calls); blocks until it ran and returns its
        result, or raises its error. Not from the driver thread itself."""
        job = _Call(fn)
        self._put(("call", job))
        if not self._wait(job.done, timeout):
            raise TimeoutError(f"the step loop did not run the call within {timeout} s")
        if job.error is not None:
            raise job.error
        return job.result

    def wake(self) -> None:
        """Let an idle loop look again (a prompt's prefill elsewhere arrived); any thread."""
        self.commands.put(("noop", None))

    def kill(self, cause: BaseException) -> None:
        """Make the step loop fail stop with `cause` at its next command (a replica whose
        other part failed: an injected `prefill` fault)."""
        self.commands.put(("die", cause))

    def shutdown(self) -> None:
        self._stop.set()
        self.commands.put(("noop", None))
        self.thread.join(timeout=10)

    def _put(self, command: tuple) -> None:
        """Queue a command; raises `EngineDeadError` once the engine is dead."""
        if self.dead is not None:
            raise self.dead
        self.commands.put(command)

    def _wait(self, done: threading.Event, timeout: float | None = None) -> bool:
        """Wait for a command queued by `_put`: True when it ran, False on timeout; raises
        `EngineDeadError` when the engine died first (`_die` answers what it finds queued,
        this covers a command queued after that)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done.wait(0.2):
            if self.dead is not None and not done.is_set():
                raise self.dead
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return True

    # ---- driver thread ------------------------------------------------------------------
    def _send(self, sub, out: StepOutput) -> StepOutput:
        """Hand `out` to the caller of `sub`; returns what was delivered."""
        raise NotImplementedError

    def _send_dead(self, sub, seq_id: int, error: EngineDeadError) -> None:
        """Tell the caller of `sub` that its request failed because the engine died."""
        self._send(sub, StepOutput(seq_id, None, None, True, "error", str(error)))

    def _flush(self) -> None:
        """What `_send` held back may go now: called after each step's outputs and after
        each round of commands (a driver that batches its messages sends them here)."""

    def _handle(self, kind: str, arg) -> None:
        if kind == "add":   # arg: a submission: prompt_ids, params, extra, done, error
            try:
                arg.seq_id = self.engine.add_request(arg.prompt_ids, arg.params, **arg.extra)
                arg.fill = self.engine.seqs[arg.seq_id].fill
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
        elif kind == "die":
            raise arg
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
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 — fail stop: whatever escaped kills it
            self._die(exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_work()
            try:
                while True:
                    kind, arg = self.commands.get(block=block, timeout=0.5 if block else None)
                    self._handle(kind, arg)
                    block = False
            except queue.Empty:
                pass
            self._flush()
            if not self.engine.has_work():
                continue
            start = time.perf_counter()
            self._fault.hit()
            for out in self.engine.step():
                self._deliver(out)
            self._flush()
            self.stats["steps"] += 1
            self.stats["last_step_s"] = time.perf_counter() - start

    def _die(self, exc: BaseException) -> None:
        log.critical("engine died: %s: %s; failing its %d request(s)", type(exc).__name__,
                     exc, len(self.streams), exc_info=exc)
        dead = EngineDeadError(f"the engine stopped: {type(exc).__name__}: {exc}")
        self.dead, self.dead_at = dead, time.monotonic()
        for seq_id, sub in list(self.streams.items()):
            try:
                self.engine.abort(seq_id)         # frees its blocks and state slot
            except Exception:  # noqa: BLE001 — the engine's state may be what broke
                log.exception("could not free request %s", seq_id)
            try:
                self._send_dead(sub, seq_id, dead)
            except Exception:  # noqa: BLE001 — tell every other caller regardless
                log.exception("could not tell request %s's caller", seq_id)
        self.streams.clear()
        try:
            self._flush()
        except Exception:  # noqa: BLE001
            log.exception("could not send the failed requests' outputs")
        while True:                               # what was queued before `dead` was set
            try:
                kind, arg = self.commands.get_nowait()
            except queue.Empty:
                break
            if kind in ("add", "call"):
                arg.error = dead
                arg.done.set()
        if self.on_dead is not None:
            try:
                self.on_dead(dead)
            except Exception:  # noqa: BLE001
                log.exception("the engine's on_dead hook failed")


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
    fill: object = None                 # the resolved RidgeFill settings (None: exact)


class QueueDriver(StepDriver):
    """For blocking callers (gRPC handler threads): `submit` waits until the request is
    accepted or refused, then the caller reads its `StepOutput`s from `events`; an
    `EngineDeadError` there instead means the engine died (nothing follows it)."""

    def submit(self, prompt_ids: list[int], params: GenerationParams, **extra) -> Submission:
        sub = Submission(prompt_ids, params, extra)
        self._put(("add", sub))
        self._wait(sub.done)
        if sub.error is not None:
            raise sub.error
        return sub

    def _send(self, sub: Submission, out: StepOutput) -> StepOutput:
        sub.events.put(out)
        return out

    def _send_dead(self, sub: Submission, seq_id: int, error: EngineDeadError) -> None:
        sub.events.put(error)         # the reader raises it (a gRPC handler: UNAVAILABLE)
