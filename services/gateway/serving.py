"""What the completions and chat endpoints share: one request fanned out into a generation
per choice, then either collected whole or merged into one SSE stream.

A client that disconnects, whole response or stream, has every generation still running
aborted, which frees its KV blocks. A generation that is refused fails the whole request
before any byte goes out; one that fails mid-stream ends the stream with its error body.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from services.common.messages import GenerationParams
from services.gateway.gateway import Delta, Gateway
from services.gateway.protocol import APIError

Jobs = list[tuple[list[int], GenerationParams]]     # (prompt ids, params) per prompt


class Fanout:
    """The generations answering one request: each prompt of the batch (one for chat) gets
    `per` candidates (`n`, or completions' `best_of`), stream `j·per + c` being candidate c
    of prompt j. Closing it aborts whatever still generates."""

    def __init__(self, gateway: Gateway, req, jobs: Jobs, arrival: float):
        self.streams, self.owner = [], []       # owner: the prompt each stream answers
        for j, (ids, params) in enumerate(jobs):
            for p in gateway.candidates(req, params):
                self.streams.append(gateway.generate(ids, p, req.stop_list(), arrival,
                                                     req.include_stop_str_in_output,
                                                     req.skip_special_tokens))
                self.owner.append(j)
        self.per = len(self.streams) // len(jobs)
        self.prompt_tokens = sum(len(ids) for ids, _ in jobs)

    async def close(self) -> None:
        await asyncio.gather(*(s.aclose() for s in self.streams), return_exceptions=True)

    async def collect(self, request: Request) -> list[Delta] | None:
        """Each generation's whole output, in stream order; None when the client hung up
        first. A refused or failed generation raises, after the others are stopped."""
        work = asyncio.ensure_future(asyncio.gather(*(_collect(s) for s in self.streams)))
        watch = asyncio.ensure_future(_until_disconnected(request))
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            await self.close()
            return None
        if work.exception() is not None:
            await self.close()
            raise work.exception()
        return list(work.result())

    async def start(self) -> list[Delta]:
        """Each generation's first delta: a refused request raises here, before the 200."""
        firsts = await asyncio.gather(*(anext(s) for s in self.streams),
                                      return_exceptions=True)
        refused = next((f for f in firsts if isinstance(f, BaseException)), None)
        if refused is not None:
            await self.close()
            raise refused
        return firsts

    async def merged(self, firsts: list[Delta]):
        """(stream index, Delta) as each stream's come, `firsts` first; raises the APIError
        of a stream that fails."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for item in self.streams[i]:
                    await queue.put((i, item))
            except APIError as exc:
                await queue.put((i, exc))
            finally:
                await queue.put((i, None))

        for i, item in enumerate(firsts):
            yield i, item
        if len(self.streams) == 1:          # nothing to merge: no pump task, no queue
            if firsts[0].reason is None:
                async for item in self.streams[0]:
                    yield 0, item
            return
        live = [i for i, item in enumerate(firsts) if item.reason is None]
        tasks = [asyncio.ensure_future(pump(i)) for i in live]
        try:
            while live:
                i, item = await queue.get()
                if item is None:
                    live.remove(i)
                elif isinstance(item, APIError):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def head(gateway: Gateway, prefix: str, obj: str) -> dict:
    """The fields every response (or chunk) of one request starts with."""
    return {"id": prefix + uuid.uuid4().hex[:24], "object": obj, "created": int(time.time()),
            "model": gateway.model_name}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI usage: completion tokens are those the model generated (an end-of-sequence
    token and a stop string's tokens included), as vLLM counts them."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse_response(fan: Fanout, firsts: list[Delta], top: dict, include_usage: bool,
                 choice: Callable[[int, Delta], dict], lead: list[dict] = ()):
    """The stream: a chunk per `lead` choice (chat's role), then `choice(i, delta)` for each
    delta as it comes, and `[DONE]`. With `include_usage` (OpenAI's `stream_options`) every
    chunk carries "usage": null and a last chunk with no choices carries the totals."""

    def chunk(choices: list, totals: dict | None = None) -> str:
        return sse({**top, "choices": choices, **({"usage": totals} if include_usage else {})})

    async def events():
        spent = [0] * len(fan.streams)
        try:
            for c in lead:
                yield chunk([c])
            async for i, delta in fan.merged(firsts):
                spent[i] = delta.n
                yield chunk([choice(i, delta)])
        except APIError as exc:      # failed mid-stream (its attention service died, say)
            yield sse(exc.body())
        else:
            if include_usage:
                yield chunk([], usage(fan.prompt_tokens, sum(spent)))
            yield "data: [DONE]\n\n"
        finally:              # the client went away (or we finished): abort frees the KV
            await fan.close()

    return StreamingResponse(events(), media_type="text/event-stream")


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _collect(stream) -> Delta:
    texts, entries, prompt, last = [], [], None, Delta("", None, 0, [])
    async for last in stream:
        texts.append(last.text)
        entries += last.logprobs
        prompt = prompt if prompt is not None else last.prompt
    return Delta("".join(texts), last.reason, last.n, entries, prompt)


async def _until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
