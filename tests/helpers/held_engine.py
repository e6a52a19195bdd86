"""An engine client that plays back a few tokens per request, optionally held until an
event is set: the gateway's limits without a model."""
from __future__ import annotations

import asyncio

from services.common.messages import StepOutput
from services.engine.protocol import EngineClient


class HeldEngine(EngineClient):
    """Each request gets `tokens`, then finishes ("length"); with `hold` set to an
    asyncio.Event, only once it is set."""

    def __init__(self, tokens=(28, 29)):
        self.tokens, self.hold, self.running, self.submitted = list(tokens), None, 0, 0

    async def submit(self, prompt_ids, params):
        self.submitted += 1
        self.running += 1
        out: asyncio.Queue = asyncio.Queue()

        async def play():
            if self.hold is not None:
                await self.hold.wait()
            for i, t in enumerate(self.tokens):
                last = i == len(self.tokens) - 1
                out.put_nowait(StepOutput(0, t, -1.0, last, "length" if last else None))
            self.running -= 1
        asyncio.ensure_future(play())
        return 0, out

    def abort(self, seq_id): ...

    def healthy(self):
        return True

    def kv_usage(self):
        return 0.0

    def num_running(self):
        return self.running

    async def refresh(self): ...
