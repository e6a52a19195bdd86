"""An `EngineClient` that plays back fixed tokens: the gateway's text, stop strings and
metrics tested without a model."""
from __future__ import annotations

import asyncio

from services.common.messages import StepOutput
from services.engine.protocol import EngineClient


class PlaybackEngine(EngineClient):
    """Plays back `tokens` (one request at a time, id 0), the last one finished with
    `reason`; records the ids it is asked to abort."""

    def __init__(self, tokens: list[int], reason: str = "length"):
        self.tokens, self.reason, self.aborted = tokens, reason, []

    async def submit(self, prompt_ids, params):
        out: asyncio.Queue = asyncio.Queue()
        for i, t in enumerate(self.tokens):
            last = i == len(self.tokens) - 1
            out.put_nowait(StepOutput(0, t, -1.0, last, self.reason if last else None))
        return 0, out

    def abort(self, seq_id):
        self.aborted.append(seq_id)

    def healthy(self):
        return True

    def kv_usage(self):
        return 0.0

    def num_running(self):
        return 0

    async def refresh(self):
        return None
