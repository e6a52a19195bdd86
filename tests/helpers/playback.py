"""An `EngineClient` that plays back fixed tokens: the gateway's text, stop strings and
metrics tested without a model."""
from __future__ import annotations

import asyncio

from services.common.messages import StepOutput
from services.engine.protocol import EngineClient


class PlaybackEngine(EngineClient):
    """Plays back `tokens` (one request at a time, id 0), the last one finished with
    `reason`, one output per turn of the event loop as an engine's steps come; records the
    ids it is asked to abort."""

    def __init__(self, tokens: list[int], reason: str = "length"):
        self.tokens, self.reason, self.aborted = tokens, reason, []

    def outputs(self) -> list[StepOutput]:
        return [StepOutput(0, t, -1.0, i == len(self.tokens) - 1,
                           self.reason if i == len(self.tokens) - 1 else None)
                for i, t in enumerate(self.tokens)]

    async def submit(self, prompt_ids, params):
        out: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.ensure_future(_play(out, self.outputs()))   # held: not collected
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


async def _play(out: asyncio.Queue, outputs: list) -> None:
    for o in outputs:
        out.put_nowait(o)
        await asyncio.sleep(0)
