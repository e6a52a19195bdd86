"""The engine in its own process (vLLM's EngineCore process), behind the same `EngineClient`
as the engine on a thread (`EngineBackend`).

Why: in one process the HTTP server, the detokenizer and the step loop share one GIL, and a
token's trip through the front end holds the next step back. Here the child process only
steps; the gateway's process only serves HTTP.

    gateway process                                engine process
    submit ── ("add", ticket, ids, params) ──────► StepDriver: add_request
           ◄── ("added", ticket, seq_id | error) ──
    reader thread ◄── ("out", [StepOutput...], load) ── one message per step, every
      └► event loop: each request's queue              request's outputs of that step
    abort ─── ("abort", seq_id) ─────────────────►
    refresh ─ ("metrics", ticket) ───────────────► its registry's exposition text

One duplex pipe (pickled tuples), written under a lock on each side. The child, a fresh
interpreter, is built by `factory()` (sent pickled: a module-level function and its
arguments), which returns the
engine and the Prometheus registry its metrics go into; those metrics reach the gateway's
`/metrics` through `refresh`.

Fail stop: a child whose step loop dies sends ("dead", why) and exits; a child that exits
any other way (killed, out of memory) closes the pipe. Either way every open request gets a
finished output with its error, later submits raise `EngineDeadError`, and `dead_since`
answers, so `/health` fails and `splitstack serve` exits. A child whose parent is gone
reads end of file and exits.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Callable

from services.common.faults import FaultPlan
from services.common.messages import EngineDeadError, GenerationParams, StepOutput
from services.common.reexport import ReExported
from services.engine.driver import StepDriver
from services.engine.protocol import EngineClient

log = logging.getLogger(__name__)

Factory = Callable[[], tuple]          # () -> (LLMEngine, CollectorRegistry | None)


class EngineProcess(EngineClient):
    def __init__(self, factory: Factory, registry=None, start_timeout_s: float = 900.0):
        """Starts the child and waits until its engine is built (the model loaded);
        raises RuntimeError with the child's error when it could not start. `registry`:
        the gateway's, which then re-exports the engine's metrics."""
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        # a fresh interpreter (`python -m services.engine.process FD`), not multiprocessing's
        # spawn, which would import the caller's main script again
        self.proc = subprocess.Popen([sys.executable, "-m", "services.engine.process",
                                      str(theirs.fileno())], pass_fds=(theirs.fileno(),))
        theirs.close()
        self._conn.send(factory)
        if not self._conn.poll(start_timeout_s):
            self.proc.kill()
            raise RuntimeError(f"the engine process did not start within {start_timeout_s:.0f} s")
        try:
            kind, info = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited with {self.proc.wait(5)}") from None
        if kind != "ready":
            self.proc.wait(10)
            raise RuntimeError(f"the engine process could not start: {info}")
        self.info: dict = info                  # max_model_len, ...
        self.metrics = ReExported()
        if registry is not None:
            registry.register(self.metrics)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()           # the tables below: reader thread vs callers
        self._tickets = itertools.count()
        self._pending: dict[int, tuple] = {}    # ticket -> (loop, future, queue)
        self._streams: dict[int, tuple] = {}    # seq_id -> (loop, queue)
        self._load = {"kv_usage": 0.0, "waiting": 0, "running": 0}
        self.dead: EngineDeadError | None = None
        self.dead_at: float | None = None
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    @property
    def max_model_len(self) -> int:
        return self.info["max_model_len"]

    # ---- EngineClient -------------------------------------------------------------------
    async def submit(self, prompt_ids: list[int],
                     params: GenerationParams) -> tuple[int, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        fut, out = loop.create_future(), asyncio.Queue()
        with self._lock:
            if self.dead is not None:
                raise self.dead
            ticket = next(self._tickets)
            self._pending[ticket] = (loop, fut, out)
        self._post(("add", ticket, list(prompt_ids), params))
        return await fut, out

    def abort(self, seq_id: int) -> None:
        if self.dead is None:
            self._post(("abort", seq_id))

    def healthy(self) -> bool:
        return self.dead is None

    def dead_since(self) -> float | None:
        return self.dead_at

    def kv_usage(self) -> float:
        return self._load["kv_usage"]

    def num_running(self) -> int:
        return self._load["running"] if self.dead is None else 0

    def open_requests(self) -> int:
        """Requests submitted here and not yet finished (their streams)."""
        with self._lock:
            return len(self._streams) + len(self._pending)

    def num_waiting(self) -> int:
        return self._load["waiting"]

    async def refresh(self) -> None:
        """The engine's metrics, as its registry reads now (within 2 s)."""
        if self.dead is not None:
            return
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            ticket = next(self._tickets)
            self._pending[ticket] = (loop, fut, None)
        self._post(("metrics", ticket))
        try:
            self.metrics.text = await asyncio.wait_for(fut, 2.0)
        except (asyncio.TimeoutError, EngineDeadError):
            with self._lock:
                self._pending.pop(ticket, None)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the child (its open requests are aborted) and waits for it."""
        if self.proc.poll() is None:
            try:
                self._post(("stop",))
            except EngineDeadError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    # ---- plumbing -------------------------------------------------------------------------
    def _post(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:      # the child is gone: the reader says why
            raise EngineDeadError(f"the engine process is gone: {exc}") from exc

    def _read(self) -> None:
        why = None
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "out":
                    self._load = message[2]
                    self._dispatch(message[1])
                elif message[0] == "added":
                    self._added(*message[1:])
                elif message[0] == "metrics":
                    self._resolve(message[1], message[2])
                elif message[0] == "dead":
                    why = message[1]
        except (EOFError, OSError):
            pass
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = "unknown (still running)"
        why = why or f"the engine process exited with code {code}"
        self._fail(EngineDeadError(f"the engine stopped: {why}"))

    def _added(self, ticket: int, seq_id: int | None, error: Exception | None) -> None:
        with self._lock:
            loop, fut, out = self._pending.pop(ticket)
            if error is None:
                self._streams[seq_id] = (loop, out)
        _call(loop, _settle, fut, seq_id, error)

    def _resolve(self, ticket: int, value) -> None:
        with self._lock:
            entry = self._pending.pop(ticket, None)
        if entry is not None:
            _call(entry[0], _settle, entry[1], value, None)

    def _dispatch(self, outs: list[StepOutput]) -> None:
        """One step's outputs: one callback per event loop, not one per token."""
        by_loop: dict = {}
        with self._lock:
            for out in outs:
                entry = self._streams.get(out.seq_id)
                if entry is None:
                    continue
                if out.finished:
                    del self._streams[out.seq_id]
                by_loop.setdefault(entry[0], []).append((entry[1], out))
        for loop, items in by_loop.items():
            if not _call(loop, _put_all, items):     # nobody listens: free their KV
                for _, out in items:
                    if not out.finished:
                        self.abort(out.seq_id)

    def _fail(self, dead: EngineDeadError) -> None:
        with self._lock:
            self.dead, self.dead_at = dead, time.monotonic()
            pending, self._pending = self._pending, {}
            streams, self._streams = self._streams, {}
        log.critical("%s; failing its %d request(s)", dead, len(streams) + len(pending))
        for loop, fut, _ in pending.values():
            _call(loop, _settle, fut, None, dead)
        for seq_id, (loop, out) in streams.items():
            _call(loop, _put_all, [(out, StepOutput(seq_id, None, None, True, "error",
                                                    str(dead)))])


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:                  # the loop is closed
        return False


def _settle(fut: asyncio.Future, value, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


def _put_all(items) -> None:
    for queue, out in items:
        queue.put_nowait(out)


# ---- the child --------------------------------------------------------------------------
class _PipeDriver(StepDriver):
    """The child's step loop: each step's outputs go to the parent as one message."""

    def __init__(self, engine, conn, send_lock: threading.Lock, faults: FaultPlan):
        self.conn, self.send_lock, self.batch = conn, send_lock, []
        super().__init__(engine, "engine", faults, on_dead=self._tell_dead)

    def send(self, message: tuple) -> None:
        with self.send_lock:
            self.conn.send(message)

    def _handle(self, kind: str, arg) -> None:
        super()._handle(kind, arg)
        if kind == "add":
            error = arg.error
            if error is not None:
                try:
                    pickle.dumps(error)
                except Exception:  # noqa: BLE001 — the parent gets its message instead
                    error = RuntimeError(f"{type(error).__name__}: {error}")
            self.send(("added", arg.ticket, arg.seq_id, error))

    def _send(self, sub, out: StepOutput) -> StepOutput:
        self.batch.append(out)
        return out

    def _flush(self) -> None:
        if self.batch:
            batch, self.batch = self.batch, []
            self.send(("out", batch, {"kv_usage": self.engine.blocks.usage,
                                      "waiting": len(self.engine.scheduler.waiting),
                                      "running": len(self.engine.scheduler.running)}))

    def _tell_dead(self, dead: EngineDeadError) -> None:
        try:
            self.send(("dead", str(dead).removeprefix("the engine stopped: ")))
        finally:
            os._exit(3)


class _Add:
    def __init__(self, ticket: int, prompt_ids: list[int], params: GenerationParams):
        self.ticket, self.prompt_ids, self.params, self.extra = ticket, prompt_ids, params, {}
        self.seq_id = self.error = None
        self.done = threading.Event()


def _compile_then_add(driver: _PipeDriver, add: _Add) -> None:
    try:
        add.extra["grammar"] = driver.engine.compile_grammar(add.params)
    except Exception as exc:  # noqa: BLE001 — a RequestError: the caller's 400
        driver.send(("added", add.ticket, None, exc))
        return
    driver.commands.put(("add", add))


def _child_main(conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # the parent decides when to stop
    try:
        engine, registry = conn.recv()()
    except BaseException as exc:  # noqa: BLE001 — told to the parent, which raises it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    send_lock = threading.Lock()
    driver = _PipeDriver(engine, conn, send_lock, FaultPlan.from_env())
    compiles = ThreadPoolExecutor(2, thread_name_prefix="grammar")    # off the step loop
    driver.send(("ready", {"max_model_len": engine.max_model_len, "pid": os.getpid()}))
    try:
        while True:
            message = conn.recv()
            if message[0] == "add":
                add = _Add(*message[1:])
                if add.params.structured is not None:
                    compiles.submit(_compile_then_add, driver, add)
                else:
                    driver.commands.put(("add", add))
            elif message[0] == "abort":
                driver.abort(message[1])
            elif message[0] == "metrics":
                from prometheus_client import generate_latest

                text = generate_latest(registry).decode() if registry is not None else ""
                driver.send(("metrics", message[1], text))
            elif message[0] == "stop":
                break
    except (EOFError, OSError):                          # the parent is gone
        pass
    driver.shutdown()


if __name__ == "__main__":
    _child_main(Connection(int(sys.argv[1])))
