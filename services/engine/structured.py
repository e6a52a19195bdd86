"""Grammar-constrained decoding (structured outputs) on xgrammar, as vLLM and SGLang do it.

A request's `GenerationParams.structured` (`StructuredSpec`: a JSON schema, any JSON object,
a regular expression or an EBNF grammar) is compiled once per distinct spec by the engine's
`Grammars` (xgrammar's `GrammarCompiler`, whose cache is keyed by the spec), off the step
loop: the embedded backends compile in the caller's executor or the engine process's
compile threads, and hand the compiled grammar to `add_request`. A spec the backend cannot
compile is a `RequestError` naming the request field, so the client gets a 400.

Each constrained sequence holds a `GrammarMatcher`. Before a step samples, `masks` fills
one packed bitmask row per constrained row (the tokens the grammar allows next); sampling
sets every other logit to -inf (`kernels.sampling.History.allowed`). After the step, each
sampled token advances its matcher; a grammar that has matched completely lets only the
end-of-sequence tokens through, so the request stops there.

JSON is generated compact (`any_whitespace=False`): a small model given free whitespace
may emit newlines until `max_tokens`.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from services.common.messages import RequestError, StructuredSpec

log = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "grammar", "tagged_json")
COMPILE_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
MASK_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1)


class Grammars:
    """One engine's grammar compiler (thread-safe: xgrammar's compiler locks its cache).
    xgrammar and the tokenizer's vocabulary table load on the first structured request."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int,
                 stop_token_ids: tuple[int, ...], metrics: StructuredMetrics | None = None,
                 threads: int = 1):
        """`load_tokenizer()`: the model's Hugging Face tokenizer, called on first use."""
        self.load_tokenizer, self.vocab_size = load_tokenizer, vocab_size
        self.stop_token_ids, self.threads = list(stop_token_ids), threads
        self.metrics = metrics
        self.compiler = None
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def _load(self) -> None:
        with self._lock:
            if self.compiler is not None:
                return
            import xgrammar as xgr

            self.tokenizer = self.load_tokenizer()
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer,
                                                      vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._xgr = xgr
            self.compiler = xgr.GrammarCompiler(info, max_threads=self.threads)

    def compile(self, spec: StructuredSpec):
        """-> xgrammar's CompiledGrammar; raises `RequestError` on `spec.field` when the
        backend cannot compile it (an unsupported schema feature, a bad regex)."""
        if spec.kind not in KINDS:
            raise RequestError(spec.field, spec.kind, f"must be one of {', '.join(KINDS)}")
        self._load()
        start = time.perf_counter()
        try:
            if spec.kind == "json_schema":
                grammar = self.compiler.compile_json_schema(spec.value, any_whitespace=False)
            elif spec.kind == "json_object":
                grammar = self.compiler.compile_builtin_json_grammar()
            elif spec.kind == "regex":
                grammar = self.compiler.compile_regex(spec.value)
            elif spec.kind == "tagged_json":
                grammar = self.compiler.compile_grammar(tagged_json(self._xgr, spec.value))
            else:
                grammar = self.compiler.compile_grammar(spec.value)
        except Exception as exc:  # noqa: BLE001 — xgrammar raises RuntimeError / ValueError
            raise RequestError(spec.field, _short(spec.value),
                               f"cannot be compiled to a grammar: {_reason(exc)}") from None
        with self._lock:
            cached = (spec.kind, spec.value) in self._seen
            self._seen.add((spec.kind, spec.value))
        if self.metrics is not None:
            self.metrics.compiled(spec.kind, time.perf_counter() - start, cached)
        return grammar

    def matcher(self, compiled, after: str | None = None) -> Matcher:
        self._load()
        return Matcher(self._xgr.GrammarMatcher(compiled), self, after)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


@dataclass
class Matcher:
    """One request's position in its grammar. With `after` (a reasoning model's end of
    thinking, `</think>`), the grammar starts with the first token after the text `after`
    was generated: until then the row is free."""
    state: object                     # xgrammar.GrammarMatcher
    grammars: Grammars
    after: str | None = None
    tail: list[int] = field(default_factory=list)    # the last tokens while waiting

    @property
    def active(self) -> bool:
        return self.after is None

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False when the grammar did not allow it."""
        if self.after is None:
            return self.state.accept_token(token)
        self.tail = self.tail[-15:] + [token]
        if self.after in self.grammars.decode(self.tail):
            self.after = None                  # the grammar applies from the next token
        return True

    @property
    def done(self) -> bool:
        return self.after is None and self.state.is_terminated()


def masks(matchers: list[Matcher | None], metrics=None) -> list[torch.Tensor | None]:
    """Each row's allowed tokens as a packed int32 bitmask [ceil(V/32)], None for an
    unconstrained row."""
    rows = [i for i, m in enumerate(matchers) if m is not None and m.active]
    if not rows:
        return [None] * len(matchers)
    start = time.perf_counter()
    first = matchers[rows[0]].grammars
    bitmask = first._xgr.allocate_token_bitmask(len(rows), first.vocab_size)
    for j, i in enumerate(rows):
        matchers[i].state.fill_next_token_bitmask(bitmask, j)
    out: list[torch.Tensor | None] = [None] * len(matchers)
    for j, i in enumerate(rows):
        out[i] = bitmask[j]
    if metrics is not None:
        metrics.masked(time.perf_counter() - start)
    return out


def tagged_json(xgr, value: str):
    """The grammar of 1..`max_items` JSON objects, each matching one of `schemas` and
    written between `prefix` and `suffix`, joined by `separator` (tool calls: the gateway's
    `tools.ToolFormat.grammar` says how its format writes them)."""
    d = json.loads(value)
    literal = lambda text: xgr.Grammar.from_ebnf("root ::= " + json.dumps(text))  # noqa: E731
    body = xgr.Grammar.from_json_schema(json.dumps({"anyOf": d["schemas"]}),
                                        any_whitespace=False)
    item = xgr.Grammar.concat(*[g for g in (d["prefix"] and literal(d["prefix"]), body,
                                            d["suffix"] and literal(d["suffix"])) if g])
    options = []
    for n in range(1, d["max_items"] + 1):
        parts = [item]
        for _ in range(n - 1):
            parts += [literal(d["separator"]), item]
        options.append(xgr.Grammar.concat(*parts) if len(parts) > 1 else item)
    return xgr.Grammar.union(*options) if len(options) > 1 else options[0]


class StructuredMetrics:
    def __init__(self, registry=None):
        from prometheus_client import Counter, Histogram

        kw = {"registry": registry} if registry is not None else {}
        self.requests = Counter("splitstack_structured_requests",
                                "Requests decoded under a grammar, by kind", ["kind"], **kw)
        self.compile_time = Histogram(
            "splitstack_grammar_compile_seconds", "Time to compile a request's grammar; "
            "cached: the spec was compiled before (xgrammar's cache)", ["cached"],
            buckets=COMPILE_BUCKETS, **kw)
        self.mask_time = Histogram(
            "splitstack_grammar_mask_seconds", "Time per step to fill the constrained rows' "
            "token bitmasks", buckets=MASK_BUCKETS, **kw)

    def compiled(self, kind: str, seconds: float, cached: bool) -> None:
        self.compile_time.labels(cached="true" if cached else "false").observe(seconds)

    def admitted(self, kind: str) -> None:
        self.requests.labels(kind=kind).inc()

    def masked(self, seconds: float) -> None:
        self.mask_time.observe(seconds)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its source location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    head, sep, rest = text.partition(": ")
    return rest if sep and (".cc:" in head or ".h:" in head) else text


def _short(value: str, limit: int = 80) -> str:
    return value if len(value) <= limit else value[:limit] + "..."
