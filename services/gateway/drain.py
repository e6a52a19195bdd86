"""Draining the gateway: SIGTERM turns readiness false, refuses new generation requests, lets
those in flight finish, then exits (Kubernetes' `preStop` and
`terminationGracePeriodSeconds` rely on it).

    SIGTERM ──► Drain.begin: /ready 503, new /v1/completions and /v1/chat/completions 503
                (Retry-After) ──► every generation request done, or `timeout_s` passed
                ──► uvicorn's shutdown (stops listening, closes idle connections) ──► exit 0

`/health` (liveness) stays 200 while draining. A second SIGTERM, or SIGINT, is uvicorn's own
shutdown at once. An engine that failed stop (`services.engine.driver`) shuts the server
down too, and `splitstack serve` exits non-zero (`EXIT_ENGINE_DEAD`), so Kubernetes restarts
it.
"""
from __future__ import annotations

import signal
import time
from typing import Callable

import uvicorn

from services.gateway.limits import GENERATION_PATHS, refuse
from services.gateway.protocol import APIError

# what uvicorn waits for tasks after the drain (a stream past `timeout_s` is then cut)
SHUTDOWN_GRACE_S = 2.0
# from the engine's death to the shutdown: its failed requests' errors go out meanwhile
DEAD_GRACE_S = 5.0
EXIT_ENGINE_DEAD = 3


class Drain:
    """The gateway's drain state and its generation requests in flight (one event loop
    changes them; the server's tick reads them)."""

    def __init__(self):
        self.since: float | None = None      # monotonic time the drain began
        self.in_flight = 0                   # generation requests, headers to last byte

    @property
    def draining(self) -> bool:
        return self.since is not None

    def begin(self) -> None:
        if self.since is None:
            self.since = time.monotonic()

    def done(self, timeout_s: float) -> bool:
        """Draining and either empty or out of time."""
        return self.draining and (self.in_flight == 0
                                  or time.monotonic() - self.since >= timeout_s)


class RefuseWhileDraining:
    """ASGI middleware: counts generation requests in flight and, once the drain began,
    answers new ones 503 with Retry-After (the client retries on another gateway)."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if self.drain.draining:
            error = APIError(503, "the server is shutting down; retry on another replica",
                             type_="server_error", code="draining")
            return await refuse(scope, receive, send, error, "draining",
                                scope["app"].state.limit_metrics, retry_after=1)
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM drains (`Drain`) before its graceful shutdown, bounded by
    `timeout_s`; the process then exits 0. When `dead_since()` (the engine's fail stop)
    turns non-None, it shuts down `DEAD_GRACE_S` later, enough for every failed request's
    error to reach its client, and `engine_died` tells the caller to exit non-zero."""

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float,
                 dead_since: Callable[[], float | None] = lambda: None):
        super().__init__(config)
        self.drain, self.timeout_s, self.dead_since = drain, timeout_s, dead_since
        self.engine_died = False
        config.timeout_graceful_shutdown = SHUTDOWN_GRACE_S

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self.drain.draining:
            self.drain.begin()       # not re-raised after the shutdown: a drained exit is 0
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.done(self.timeout_s):
            self.should_exit = True
        died = self.dead_since()
        if died is not None and time.monotonic() - died >= DEAD_GRACE_S:
            self.engine_died = self.should_exit = True
        return await super().on_tick(counter)
