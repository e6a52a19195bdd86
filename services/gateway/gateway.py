"""The gateway's core: OpenAI request fields -> engine requests, and each engine request's
outputs -> text deltas (incremental detokenization, stop strings, log-probs, metrics).

Requests are validated twice: by the pydantic bodies (types, ranges) and by the engine
(`RequestError`: empty prompt, context overflow). Both become a 4xx with an OpenAI-style
error body.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from kernels.sampling import SamplingError, SamplingParams
from services.common.messages import (EngineDeadError, GenerationParams, PrefillRequest,
                                      RequestError, Unavailable)
from services.engine.protocol import EngineClient
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.logprobs import TokenLogprob, TokenText
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import APIError, ChatCompletionRequest, CompletionRequest, _Common
from services.gateway.reasoning import PARSERS as REASONING
from services.gateway.stops import StopStrings
from services.gateway.tools import FORMATS, default_format
from services.gateway.tracing import RequestTrace

TOOLS_TEMPLATE = Path(__file__).resolve().parent / "templates" / "hermes_tools.jinja"


class Gateway:
    """`backend`: an `EngineBackend` (embedded engine) or an `AttentionClient` (attention
    services over gRPC)."""

    def __init__(self, backend: EngineClient, tokenizer, model_name: str, max_model_len: int,
                 default_temperature: float = 1.0, metrics: GatewayMetrics | None = None,
                 chat_template: str | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None):
        """A request's prefill fields travel as given (`PrefillRequest`): the engine that
        owns its prefill checks them. `chat_template`: replaces the tokenizer's (jinja
        text, `--chat-template`); `tool_call_parser`: the format of tool calls
        (`tools.FORMATS`; default: the one the template implies); `reasoning_parser`:
        splits a thinking model's reasoning from its answer (`reasoning.PARSERS`)."""
        self.reasoning = REASONING[reasoning_parser] if reasoning_parser else None
        self.backend = backend
        self.chat_template = chat_template
        own = chat_template or getattr(tokenizer, "chat_template", None)
        self.tool_format = FORMATS[tool_call_parser or default_format(own)]
        # a template that cannot render tools (SmolLM2's) gives way to the shipped one when
        # a request offers tools or its history holds calls
        self.tools_template = (chat_template if chat_template or (own and "tool" in own)
                               else TOOLS_TEMPLATE.read_text())
        self.default_temperature = default_temperature   # from generation_config.json
        self.tokenizer = tokenizer
        self.words = TokenText(tokenizer)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics or GatewayMetrics()
        self.metrics.describe(model_name, max_model_len)

    # ---- request -> engine ----------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                                f"{self.model_name!r}", "model", code="model_not_found")

    def params(self, req: _Common, prompt_len: int, max_tokens: int | None) -> GenerationParams:
        """`max_tokens`: what the request asked for (None: up to the context length); a
        refusal names the field the client sent it as (chat's `max_completion_tokens`)."""
        self.check_model(req.model)
        req.check_supported()
        field = req.max_new_tokens()[1]
        if max_tokens is None:
            if prompt_len >= self.max_model_len:
                raise APIError(400, f"the prompt ({prompt_len} tokens) leaves no room in the "
                                    f"context length {self.max_model_len}",
                               req.prompt_field())
            max_tokens = self.max_model_len - prompt_len
        if max_tokens <= 0:
            raise APIError(400, f"{field} must be a positive integer, got {max_tokens}", field)
        if prompt_len + max_tokens > self.max_model_len:
            raise APIError(400, f"prompt ({prompt_len} tokens) + {field} ({max_tokens}) "
                                f"exceeds the context length {self.max_model_len}", field)
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
                                    prefill=prefill_request(req),
                                    replay_ratio=req.replay_ratio,
                                    structured=req.structured_spec())
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

    def completion_ids(self, req: CompletionRequest) -> list[list[int]]:
        """Each prompt of the batch as token ids."""
        return [list(p) if isinstance(p, list) else
                self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in req.prompts()]

    def chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        messages = [m.rendered() for m in req.messages]
        kwargs = req.template_kwargs()
        template = self.chat_template
        if req.tools or any(m.tool_calls or m.role == "tool" for m in req.messages):
            template = self.tools_template
            if req.tools:
                kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False, chat_template=template,
                                                      **kwargs)
        except Exception as exc:  # noqa: BLE001 — jinja's errors: the messages don't fit it
            raise APIError(400, f"the chat template cannot render these messages: {exc}",
                           "messages") from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # ---- generation -----------------------------------------------------------------
    async def generate(self, ids: list[int], params: GenerationParams, stops: list[str],
                       arrival: float, include_stop: bool = False, skip_special: bool = True):
        """Yields `Delta`s (new text, finish reason, tokens generated so far, and with
        `params.logprobs` the new tokens' log-probs); aborts the request when closed early.
        The text ends before the first stop string to end after `params.min_tokens` tokens
        (after it with `include_stop`); text that may still begin one is held back until it
        cannot. The request is counted once, under its outcome."""
        traced = RequestTrace(self.model_name, params, len(ids))
        try:
            with traced.current():           # a member's spans join the request's trace
                seq_id, out = await self.backend.submit(ids, params)
        except RequestError as exc:
            traced.finish("refused", 0, time.perf_counter() - arrival)
            raise APIError(400, str(exc), exc.field) from exc
        except (EngineDeadError, Unavailable) as exc:
            traced.finish("error", 0, time.perf_counter() - arrival)
            raise APIError(503, str(exc), type_="service_unavailable",
                           code="engine_dead" if isinstance(exc, EngineDeadError)
                           else None) from exc
        self.metrics.prompt_tokens.inc(len(ids))
        detok = IncrementalDetokenizer(self.tokenizer, skip_special)
        stop = StopStrings(stops, include_stop)
        count = 0                              # tokens generated
        entries: list[TokenLogprob] = []       # tokens not yet sent with a delta
        prompt = None                          # the prompt's log-probs, for the first delta
        first = last = None                    # when the first and the last token came
        finished = False                       # the engine has let the request go
        outcome = "abort"                      # what the request is counted as
        try:
            while True:
                # what has come since the last delta, one delta for all of it (an engine
                # that streams a step's tokens at once, or a reader that fell behind)
                steps = [await out.get()]
                while not out.empty():
                    steps.append(out.get_nowait())
                now = time.perf_counter()
                text, reason = "", None
                for step in steps:
                    if step.error:
                        finished, outcome = step.finished, "error"
                        raise APIError(500, f"generation failed: {step.error}",
                                       type_="server_error")
                    new = ""
                    if step.token is not None:
                        if last is None:
                            first = now
                            self._observe_first(step, now - arrival)
                            traced.first(step, now - arrival)
                        else:
                            self.metrics.itl.observe(now - last)
                        last = now
                        count += 1
                        self.metrics.generation_tokens.inc()
                        if params.logprobs is not None:
                            entries.append(TokenLogprob(step.token, step.logprob,
                                                        list(step.top_logprobs or ())))
                        if step.prompt_logprobs is not None:
                            prompt = step.prompt_logprobs
                        new = detok.add(step.token)
                    reason = step.finish_reason if step.finished else None
                    if reason:
                        new += detok.pending       # the stream's last bytes, complete or not
                    # stop strings ending within the first min_tokens tokens come too early
                    more, stopped = stop.feed(new, armed=count > params.min_tokens)
                    text += more
                    if stopped:
                        reason = "stop"
                    elif reason:
                        text += stop.flush()
                    if reason:   # settled before the last yield: the caller may close there
                        finished, outcome = step.finished, reason
                        self.metrics.e2e.observe(now - arrival)
                        if first is not None:
                            self.metrics.decode_time.observe(now - first)
                            if count > 1:
                                self.metrics.tpot.observe((now - first) / (count - 1))
                        break
                if text or reason:
                    yield Delta(text, reason, count, entries, prompt)
                    entries, prompt = [], None
                if reason:
                    return
        finally:
            if not finished:           # a stop string, a client gone, or a failed stream
                self.backend.abort(seq_id)
            self.metrics.finish(outcome, len(ids), count)
            self.metrics.kv_usage.set(self.backend.kv_usage())
            traced.finish(outcome, count, time.perf_counter() - arrival)

    def _observe_first(self, step, ttft: float) -> None:
        """A request's first token: its TTFT, and the engine's queue and prefill times."""
        self.metrics.ttft.observe(ttft)
        if step.queue_s is not None:
            self.metrics.queue_time.observe(step.queue_s)
            self.metrics.prefill_time.observe(step.prefill_s)


def prefill_request(req: _Common) -> PrefillRequest | None:
    if req.prefill_mode is None and req.ridgefill is None:
        return None
    return PrefillRequest(req.prefill_mode, req.ridgefill)


class Delta(NamedTuple):
    text: str
    reason: str | None                 # the finish reason, on the last one
    n: int                             # tokens generated so far
    logprobs: list[TokenLogprob]       # the tokens since the previous delta (when asked)
    prompt: list[TokenLogprob] | None = None   # the first delta: prompt log-probs (echo)


def _next_seed(seed: int, i: int) -> int:
    """seed + i, wrapped into torch's seed range [-2**63, 2**64)."""
    s = seed + i
    return s - 2**64 if s >= 2**64 else s
