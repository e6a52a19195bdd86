"""One streamed request, timed from its server-sent events the way `vllm bench serve`
times them: TTFT is the arrival of the first chunk with generated content, each later
chunk adds an inter-token latency (ITL), E2EL ends at `[DONE]`, and the token counts come
from the usage chunk (`stream_options.include_usage`). A request cancelled at the time
bound keeps what it saw, its times censored at the cancel (`RequestResult.censor`)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from loadtest.scenarios import RequestSpec


class LoadTestError(Exception):
    """The run cannot start: the server is unreachable, or refuses the first request."""


CANCELLED = "cancelled at --max-seconds"


@dataclass
class RequestResult:
    kind: str
    start: float = 0.0                 # time.perf_counter() at send
    success: bool = False
    cancelled: bool = False            # cut off at the time bound; times censored
    error: str = ""
    ttft: float = 0.0                  # seconds
    latency: float = 0.0               # seconds, E2EL
    itl: list[float] = field(default_factory=list)   # seconds between chunks
    prompt_len: int = 0                # usage.prompt_tokens (else the spec's count)
    output_tokens: int = 0             # usage.completion_tokens (chunks when absent)
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each chunk

    @property
    def status(self) -> str:
        return "completed" if self.success else "cancelled" if self.cancelled else "failed"

    def censor(self, now: float) -> None:
        """Cut off at `now` (perf_counter) before its end: E2EL becomes the time until the
        cancel, and so does TTFT when no token came; the open gap since the last chunk
        joins the ITLs. Each is a lower bound of what the request would have taken, so
        that counting it keeps the tail from looking shorter than it was."""
        self.cancelled, self.success, self.error = True, False, CANCELLED
        self.latency = now - self.start
        if not self.chunk_times:
            self.ttft = self.latency
        else:
            self.itl.append(now - self.chunk_times[-1])
        self.output_tokens = len(self.chunk_times)


def headers_for(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_text(status: int, raw: bytes) -> str:
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw[:200].decode(errors="replace")
    return f"HTTP {status}: {message}"


def _is_content(chat: bool, choice: dict) -> bool:
    """A chunk that stands for generated tokens: any but chat's leading role chunk (a
    delta may be empty while the server holds back text, as for a partial character)."""
    return not (chat and "role" in (choice.get("delta") or {}))


async def _read(client: httpx.AsyncClient, spec: RequestSpec, body: dict, headers: dict,
                out: RequestResult) -> bool:
    """Reads the stream into `out`; True once `[DONE]` came."""
    chat = spec.path.endswith("/chat/completions")
    async with client.stream("POST", spec.path, json=body, headers=headers) as r:
        if r.status_code != 200:
            out.error = _error_text(r.status_code, await r.aread())
            return False
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return True
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
                out.error = "stream error: " + str(error.get("message", error)
                                                   if isinstance(error, dict) else error)
                return False
            choices = event.get("choices")
            if choices and _is_content(chat, choices[0]):
                now = time.perf_counter()
                if not out.chunk_times:
                    out.ttft = now - out.start
                else:
                    out.itl.append(now - out.chunk_times[-1])
                out.chunk_times.append(now)
            if usage := event.get("usage"):
                out.prompt_len = usage.get("prompt_tokens", 0)
                out.output_tokens = usage.get("completion_tokens", 0)
    return False


async def send(client: httpx.AsyncClient, spec: RequestSpec, model: str,
               headers: dict, out: RequestResult | None = None) -> RequestResult:
    """One request, streamed, into `out` (a new result when None); never raises for what
    the server or the network does (the result's `error` says it). `out.start` is set
    before the first await, so a caller that cancels the task can `censor` `out`."""
    body = {**spec.body, "model": model, "stream": True,
            "stream_options": {"include_usage": True}}
    out = out or RequestResult(spec.kind)
    out.prompt_len = spec.prompt_len         # the usage chunk's count replaces it
    out.start = time.perf_counter()
    try:
        done = await _read(client, spec, body, headers, out)
    except (httpx.HTTPError, ValueError) as exc:    # ValueError: an event that is not JSON
        out.error, done = f"{type(exc).__name__}: {exc}", False
    out.latency = time.perf_counter() - out.start
    if out.error:
        return out
    if not done:
        out.error = "stream ended without [DONE]"
    elif not out.chunk_times:
        out.error = "stream had no content chunk"
    else:
        out.output_tokens = out.output_tokens or len(out.chunk_times)
        out.success = True
    return out


def server_info(base: str, headers: dict, timeout: float = 10.0) -> dict:
    """GET /v1/models: the first model's `id` and `max_model_len` (8192 when not said)."""
    try:
        r = httpx.get(base + "/v1/models", headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise LoadTestError(f"cannot reach {base}: {type(exc).__name__}: {exc}") from exc
    if r.status_code != 200:
        raise LoadTestError(f"{base}/v1/models: {_error_text(r.status_code, r.content)}")
    try:
        card = r.json()["data"][0]
        return {"id": card["id"], "max_model_len": int(card.get("max_model_len") or 8192)}
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise LoadTestError(f"{base}/v1/models did not list a model: {r.text[:200]}") from exc


class ServerTokenCounter:
    """Counts tokens with the server's own tokenizer (vLLM's `POST /tokenize`); `None` from
    `probe` when the server has no such route."""

    def __init__(self, base: str, model: str, headers: dict):
        self.client = httpx.Client(base_url=base, headers=headers, timeout=60)
        self.model = model

    def __call__(self, text: str) -> int:
        r = self.client.post("/tokenize", json={"model": self.model, "prompt": text})
        if r.status_code != 200:
            raise LoadTestError(f"/tokenize: {_error_text(r.status_code, r.content)}")
        return int(r.json()["count"])

    @classmethod
    def probe(cls, base: str, model: str, headers: dict) -> ServerTokenCounter | None:
        counter = cls(base, model, headers)
        try:
            counter("probe")
        except (LoadTestError, httpx.HTTPError, KeyError, ValueError):
            counter.client.close()
            return None
        return counter
