"""OpenAI-compatible HTTP gateway (FastAPI): completions, chat completions, SSE streaming.

Requests are tokenized here and validated twice: by the pydantic bodies (types, ranges) and
by the engine (`RequestError`: empty prompt, context overflow). Both become a 4xx with an
OpenAI-style error body. A client that disconnects mid-stream has its request aborted, which
frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import replace
from typing import NamedTuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest

from kernels.sampling import SamplingError, SamplingParams
from services.engine import GenerationParams, RequestError
from services.gateway.logprobs import (TokenLogprob, TokenText, chat_logprobs,
                                       completion_logprobs)
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                       DetokenizeRequest, TokenizeRequest, _Common)
from services.prefill.service import RemotePrefill


class Gateway:
    """`backend`: an `EngineBackend` (embedded engine) or a `ClusterBackend` (attention
    services over gRPC); both offer submit / abort / healthy / kv_usage / num_running /
    refresh."""

    def __init__(self, backend, tokenizer, model_name: str, max_model_len: int,
                 default_temperature: float = 1.0, prefill_service=None,
                 metrics: GatewayMetrics | None = None, remote_prefill: bool = False):
        """`prefill_service`: resolves RidgeFill fields here (embedded engine);
        `remote_prefill`: they travel as given and the prefill service checks them."""
        self.backend = backend
        self.prefill_service = prefill_service
        self.remote_prefill = remote_prefill
        self.default_temperature = default_temperature   # from generation_config.json
        self.tokenizer = tokenizer
        self.words = TokenText(tokenizer)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics or GatewayMetrics()

    # ---- request -> engine ----------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                                f"{self.model_name!r}", "model", code="model_not_found")

    def params(self, req: _Common, prompt_len: int, max_tokens: int | None) -> GenerationParams:
        self.check_model(req.model)
        req.check_supported()
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - prompt_len)
        if max_tokens <= 0:
            raise APIError(400, f"max_tokens must be a positive integer, got {max_tokens}",
                           "max_tokens")
        try:
            temperature = (self.default_temperature if req.temperature is None
                           else req.temperature)
            sampling = SamplingParams(temperature=temperature, top_k=req.top_k,
                                      top_p=req.top_p, seed=req.seed,
                                      presence_penalty=req.presence_penalty or 0.0,
                                      frequency_penalty=req.frequency_penalty or 0.0,
                                      repetition_penalty=req.repetition_penalty or 1.0,
                                      logit_bias=req.logit_bias_pairs())
            return GenerationParams(max_tokens=max_tokens, sampling=sampling,
                                    ignore_eos=req.ignore_eos, logprobs=req.logprobs_k(),
                                    min_tokens=req.min_tokens or 0,
                                    prompt_logprobs=req.prompt_logprobs_k(),
                                    stop_token_ids=tuple(req.stop_token_ids or ()),
                                    prefill=self.prefill_settings(req, prompt_len),
                                    replay_ratio=req.replay_ratio)
        except (SamplingError, RequestError) as exc:
            raise APIError(400, str(exc), getattr(exc, "field", None)) from exc

    def candidates(self, req: _Common, params: GenerationParams) -> list[GenerationParams]:
        """One engine request per completion to generate (`n`, or completions' `best_of`).
        A seeded request's candidates draw with seed, seed + 1, ..., each reproducible; for
        `best_of` the sampled tokens' log-probs are kept to rank them, asked for or not."""
        count = req.candidates()
        if count == 1:
            return [params]
        if count > req.n and params.logprobs is None:
            params = replace(params, logprobs=0)
        seed = params.sampling.seed
        return [params if seed is None else
                replace(params, sampling=replace(params.sampling, seed=_next_seed(seed, i)))
                for i in range(count)]

    def prefill_settings(self, req: _Common, prompt_len: int):
        if self.remote_prefill:
            if req.prefill_mode is None and req.ridgefill is None:
                return None
            return RemotePrefill(req.prefill_mode, req.ridgefill)
        if self.prefill_service is None:
            if req.prefill_mode not in (None, "exact") or req.ridgefill:
                raise APIError(400, "this server has no RidgeFill prefill service (start it "
                                    "with --maps)", "prefill_mode")
            return None
        try:
            return self.prefill_service.resolve(req.prefill_mode, req.ridgefill, prompt_len)
        except ValueError as exc:
            raise APIError(400, str(exc), "ridgefill") from exc

    def completion_ids(self, req: CompletionRequest) -> list[list[int]]:
        """Each prompt of the batch as token ids."""
        return [list(p) if isinstance(p, list) else
                self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in req.prompts()]

    def chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # ---- generation -----------------------------------------------------------------
    async def generate(self, ids: list[int], params: GenerationParams, stops: list[str],
                       arrival: float, include_stop: bool = False, skip_special: bool = True):
        """Yields `Delta`s (new text, finish reason, tokens generated so far, and with
        `params.logprobs` the new tokens' log-probs); aborts the request when closed early.
        The text ends before the first stop string found after `params.min_tokens` tokens
        (after it with `include_stop`)."""
        try:
            seq_id, out = await self.backend.submit(ids, params)
        except RequestError as exc:
            raise APIError(400, str(exc), exc.field) from exc
        self.metrics.prompt_tokens.inc(len(ids))
        tokens: list[int] = []
        pending: list[TokenLogprob] = []      # tokens not yet sent with a delta
        prompt = None                          # the prompt's log-probs, for the first delta
        sent, last, finished, floor = "", None, False, 0
        try:
            while True:
                step = await out.get()
                now = time.perf_counter()
                if step.error:
                    self.metrics.requests.labels("error").inc()
                    raise APIError(500, f"generation failed: {step.error}", type_="server_error")
                if step.token is not None:
                    (self.metrics.ttft if last is None else self.metrics.itl).observe(
                        now - (arrival if last is None else last))
                    last = now
                    tokens.append(step.token)
                    self.metrics.generation_tokens.inc()
                    if params.logprobs is not None:
                        pending.append(TokenLogprob(step.token, step.logprob,
                                                    list(step.top_logprobs or ())))
                    if step.prompt_logprobs is not None:
                        prompt = step.prompt_logprobs
                text = self.tokenizer.decode(tokens, skip_special_tokens=skip_special)
                reason = step.finish_reason if step.finished else None
                if len(tokens) <= params.min_tokens:
                    floor = len(text)       # stop strings ending in here came too early
                else:
                    hit = [(at, s) for s in stops if s and
                           (at := text.find(s, max(0, floor - len(s) + 1))) >= 0]
                    if hit:
                        at, stop = min(hit)
                        text = text[:at + (len(stop) if include_stop else 0)]
                        reason = "stop"
                if text.endswith("\ufffd") and reason is None:
                    continue                          # wait for the rest of a multibyte char
                if len(text) > len(sent) or reason:
                    yield Delta(text[len(sent):], reason, len(tokens), pending, prompt)
                    sent, pending, prompt = text, [], None
                if reason:
                    finished = step.finished
                    self.metrics.e2e.observe(now - arrival)
                    self.metrics.requests.labels(reason).inc()
                    return
        finally:
            if not finished:
                self.backend.abort(seq_id)
                self.metrics.requests.labels("abort").inc()
            self.metrics.kv_usage.set(self.backend.kv_usage())
            self.metrics.running.set(self.backend.num_running())


class RequireAPIKey:
    """ASGI middleware: every `/v1/` route needs `Authorization: Bearer <key>` (vLLM's
    `--api-key`); `/health` and `/metrics` stay open for probes and scrapers. Pure ASGI, so
    streamed responses and disconnects pass through untouched."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "missing or invalid API key: send 'Authorization: Bearer "
                                      "<key>'", code="invalid_api_key")
                response = JSONResponse(error.body(), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(gateway: Gateway, api_key: str | None = None) -> FastAPI:
    """`api_key`: clients of the `/v1/` routes must send it as a bearer token."""
    app = FastAPI(title="splitstack")
    app.state.gateway = gateway
    if api_key:
        app.add_middleware(RequireAPIKey, key=api_key)

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(APIError(400, "request body is not valid JSON").body(), 400)
        # `param` names the top-level field (OpenAI's); the message has the whole path
        loc = first.get("loc", ())
        loc = str(loc[1]) if len(loc) > 1 else None
        msg = "; ".join(f"{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in errors)
        return JSONResponse(APIError(400, msg, loc).body(), status_code=400)

    @app.get("/health")
    async def health():
        alive = gateway.backend.healthy()
        return JSONResponse({"status": "ok" if alive else "no engine is serving"},
                            status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        await gateway.backend.refresh()
        gateway.metrics.kv_usage.set(gateway.backend.kv_usage())
        return Response(generate_latest(gateway.metrics.registry),
                        media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": gateway.model_name, "object": "model",
                                            "created": 0, "owned_by": "splitstack",
                                            "max_model_len": gateway.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        """vLLM's: the prompt's token ids (or the chat template's, for messages)."""
        gateway.check_model(req.model)
        req.check()
        if req.messages is not None:
            text = gateway.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in req.messages],
                add_generation_prompt=req.add_generation_prompt, tokenize=False)
            ids = gateway.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = gateway.tokenizer(req.prompt,
                                    add_special_tokens=req.add_special_tokens)["input_ids"]
        return {"tokens": ids, "count": len(ids), "max_model_len": gateway.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        gateway.check_model(req.model)
        vocab = len(gateway.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:4]}", "tokens")
        return {"prompt": gateway.tokenizer.decode(req.tokens)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        arrival = time.perf_counter()
        jobs = [(ids, gateway.params(req, len(ids), req.max_tokens))
                for ids in gateway.completion_ids(req)]
        return await respond(gateway, req, jobs, arrival, chat=False, request=request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        arrival = time.perf_counter()
        ids = gateway.chat_ids(req)
        params = gateway.params(req, len(ids), req.max_completion_tokens or req.max_tokens)
        return await respond(gateway, req, [(ids, params)], arrival, chat=True, request=request)

    return app


class Delta(NamedTuple):
    text: str
    reason: str | None                 # the finish reason, on the last one
    n: int                             # tokens generated so far
    logprobs: list[TokenLogprob]       # the tokens since the previous delta (when asked)
    prompt: list[TokenLogprob] | None = None   # the first delta: prompt log-probs (echo)


async def collect(stream) -> Delta:
    text, entries, prompt, last = "", [], None, Delta("", None, 0, [])
    async for last in stream:
        text += last.text
        entries += last.logprobs
        prompt = prompt if prompt is not None else last.prompt
    return Delta(text, last.reason, last.n, entries, prompt)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI usage: completion tokens are those the model generated (an end-of-sequence
    token and a stop string's tokens included), as vLLM counts them."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


async def respond(gateway: Gateway, req, jobs: list[tuple[list[int], GenerationParams]],
                  arrival, chat: bool, request: Request):
    """`jobs`: (prompt ids, params) per prompt of the batch (one for chat); each prompt gets
    its n choices, indexed prompt·n + choice as OpenAI's batched completions are."""
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    report = jobs[0][1].logprobs is not None
    n = req.n
    streams, owner = [], []            # owner: the prompt each stream answers
    for j, (ids, params) in enumerate(jobs):
        for p in gateway.candidates(req, params):
            streams.append(gateway.generate(ids, p, req.stop_list(), arrival,
                                            req.include_stop_str_in_output,
                                            req.skip_special_tokens))
            owner.append(j)
    per = len(streams) // len(jobs)    # candidates per prompt (best_of, else n)
    prompt_tokens = sum(len(ids) for ids, _ in jobs)
    offsets = [0] * len(streams)       # completions: where each choice's next text starts
    echo = getattr(req, "echo", False)
    texts = req.prompts() if echo else []

    def echoed(j: int, d: Delta) -> tuple[str, list[TokenLogprob]]:
        """A choice's first text and log-probs, its prompt's first with `echo`."""
        if not echo:
            return d.text, d.logprobs
        ids = jobs[j][0]
        prefix = texts[j] if isinstance(texts[j], str) else gateway.tokenizer.decode(ids)
        first = [TokenLogprob(ids[0], None, [])] if d.prompt is not None else []
        return prefix + d.text, first + (d.prompt or []) + d.logprobs

    def logprobs_of(i: int, entries: list[TokenLogprob]) -> dict | None:
        if not report:
            return None
        if chat:
            return chat_logprobs(gateway.words, entries)
        out, offsets[i] = completion_logprobs(gateway.words, entries, offsets[i])
        return out

    async def close_all() -> None:     # aborts whatever is still generating, frees its KV
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)

    if not req.stream:
        # a client that hangs up before the answer is ready gets its requests aborted too
        work = asyncio.ensure_future(asyncio.gather(*(collect(s) for s in streams)))
        watch = asyncio.ensure_future(until_disconnected(request))
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            await close_all()
            return Response(status_code=499)
        if work.exception() is not None:      # one refused or failed: the others stop too
            await close_all()
            raise work.exception()
        results = list(work.result())
        spent = sum(r.n for r in results)
        kept = []                  # (prompt, result), n per prompt in order
        for j in range(len(jobs)):
            cands = results[j * per:(j + 1) * per]
            if per > n:            # best_of: the n with the highest log-probability
                cands = sorted(cands, key=lambda r: -sum(e.logprob for e in r.logprobs))[:n]
            kept += [(j, r) for r in cands]
        choices = []
        for i, (j, r) in enumerate(kept):
            text, entries = echoed(j, r)
            choice = ({"index": i, "message": {"role": "assistant", "content": text},
                       "finish_reason": r.reason} if chat else
                      {"index": i, "text": text, "finish_reason": r.reason})
            choice["logprobs"] = logprobs_of(i, entries)
            choices.append(choice)
        return {"id": rid, "object": obj, "created": created, "model": gateway.model_name,
                "choices": choices, "usage": usage(prompt_tokens, spent)}
    # validate before the 200 goes out: a refused request raises APIError on its first item
    firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    refused = next((f for f in firsts if isinstance(f, BaseException)), None)
    if refused is not None:
        await close_all()
        raise refused

    async def merged():
        """(choice index, Delta) as each choice's come, after the first ones; an APIError
        when a choice fails."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for item in streams[i]:
                    await queue.put((i, item))
            except APIError as exc:
                await queue.put((i, exc))
            finally:
                await queue.put((i, None))

        for i, item in enumerate(firsts):
            yield i, item
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

    async def events():
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        # stream_options.include_usage: every chunk carries "usage": null and a last chunk
        # with no choices carries the totals (OpenAI's streaming usage)
        with_usage = req.stream_options is not None and req.stream_options.include_usage
        head = {"id": rid, "object": chunk_obj, "created": created,
                "model": gateway.model_name}

        def chunk(choices: list, totals: dict | None = None) -> str:
            return _sse({**head, "choices": choices,
                         **({"usage": totals} if with_usage else {})})

        if chat:
            for i in range(len(streams)):
                yield chunk([{"index": i, "delta": {"role": "assistant"},
                              "finish_reason": None}])
        spent, started = [0] * len(streams), [False] * len(streams)
        try:
            async for i, item in merged():
                spent[i], reason = item.n, item.reason
                delta, entries = (echoed(owner[i], item) if not started[i]
                                  else (item.text, item.logprobs))
                started[i] = True
                choice = ({"index": i, "delta": {"content": delta} if delta else {},
                           "finish_reason": reason} if chat else
                          {"index": i, "text": delta, "finish_reason": reason})
                choice["logprobs"] = logprobs_of(i, entries)
                yield chunk([choice])
        except APIError as exc:      # failed mid-stream (its attention service died, say)
            yield _sse(exc.body())
        else:
            if with_usage:
                yield chunk([], usage(prompt_tokens, sum(spent)))
            yield "data: [DONE]\n\n"
        finally:              # the client went away (or we finished): abort frees the KV
            await close_all()

    return StreamingResponse(events(), media_type="text/event-stream")


def _next_seed(seed: int, i: int) -> int:
    """seed + i, wrapped into torch's seed range [-2**63, 2**64)."""
    s = seed + i
    return s - 2**64 if s >= 2**64 else s


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
