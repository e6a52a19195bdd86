"""The one interface the gateway talks to an engine through (vLLM's `engine/protocol.py`).

Three implement it: `EngineBackend` (the engine in this process, on its own thread,
`services.engine.backend`), `EngineProcess` (the engine in a child process,
`services.engine.process`) and `AttentionClient` (attention services over gRPC,
`services.attention.client`). The gateway calls every method from its event loop.
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod

from services.common.messages import GenerationParams


class EngineClient(ABC):
    # seconds between `refresh` calls the gateway makes in the background, for a client
    # whose `refresh` calls other processes over the network (so a scrape of /metrics never
    # waits on them); None: /metrics calls `refresh` itself
    poll_interval_s: float | None = None

    @abstractmethod
    async def submit(self, prompt_ids: list[int],
                     params: GenerationParams) -> tuple[int, asyncio.Queue]:
        """Admits a request; returns its id and the queue its `StepOutput`s arrive on, the
        last one `finished` (a failure is a finished output with `error`). A refused request
        raises `RequestError` and holds nothing."""

    @abstractmethod
    def abort(self, seq_id: int) -> None:
        """Stops a request and frees its KV; its queue then gets a finished output (reason
        "abort") unless it had finished. Safe to call for a finished or unknown id."""

    @abstractmethod
    def healthy(self) -> bool:
        """Whether a request submitted now can be served (readiness: `/ready`)."""

    def dead_since(self) -> float | None:
        """When (monotonic) the engine behind this client failed stop, None while it lives
        (liveness: `/health`). A gateway in front of attention services never dies of
        theirs: each fails stop on its own and its requests migrate."""
        return None

    @abstractmethod
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, 0-1 (the fullest engine's); a backend that polls
        it reports what the last `refresh` saw."""

    @abstractmethod
    def num_running(self) -> int:
        """Requests the engine schedules now (vLLM's `num_requests_running`): admitted to
        its running set, prefilling or decoding; waiting ones are `num_waiting`. What the
        last `refresh` (or step report) saw, for a backend that polls it."""

    def num_waiting(self) -> int:
        """Requests submitted and not yet scheduled (what the last `refresh` saw, for a
        backend that polls it; 0 for one that cannot tell)."""
        return 0

    def close(self) -> None:
        """Stops what the client started (an engine process); the server calls it last."""

    @abstractmethod
    async def refresh(self) -> None:
        """Polls whatever `kv_usage` and the metrics read from: before each `/metrics`, or
        every `poll_interval_s` when that is set."""
