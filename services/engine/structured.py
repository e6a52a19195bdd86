"""Grammar-constrained decoding (structured outputs) on xgrammar, as vLLM and SGLang do it,
with llguidance (vLLM's `guidance` backend) behind the same interface.

A request's `GenerationParams.structured` (`StructuredSpec`: a JSON schema, any JSON object,
a regular expression or an EBNF grammar) is compiled once per distinct spec by the engine's
`Grammars` (xgrammar's `GrammarCompiler`, whose cache is keyed by the spec), off the step
loop: the embedded backends compile in the caller's executor or the engine process's
compile threads, and hand the compiled grammar to `add_request`. A spec the backend cannot
compile is a `RequestError` naming the request field, so the client gets a 400.

Backends (`--structured-outputs-backend`, vLLM's `structured_outputs_config.backend`):
`xgrammar`, `guidance` (llguidance), or `auto` (the default): xgrammar, and llguidance for a
spec xgrammar cannot compile (as vLLM's `auto` falls back); the 400 then gives both reasons.
Both fill the same packed int32 bitmask (a set bit: the token is allowed).

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
BACKENDS = ("auto", "xgrammar", "guidance")
COMPILE_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
MASK_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1)


@dataclass(frozen=True)
class Compiled:
    """A spec compiled by one backend: xgrammar's CompiledGrammar, or llguidance's
    validated grammar text."""
    backend: str
    grammar: object


class Grammars:
    """One engine's grammar compilers (thread-safe: xgrammar's compiler locks its cache).
    A backend and the tokenizer's vocabulary table for it load on the first structured
    request that needs them."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int,
                 stop_token_ids: tuple[int, ...], metrics: StructuredMetrics | None = None,
                 threads: int = 1, backend: str = "auto"):
        """`load_tokenizer()`: the model's Hugging Face tokenizer, called on first use;
        `backend`: one of BACKENDS."""
        if backend not in BACKENDS:
            raise ValueError(f"structured outputs backend {backend!r}: one of "
                             f"{', '.join(BACKENDS)}")
        self.load_tokenizer, self.vocab_size = load_tokenizer, vocab_size
        self.stop_token_ids, self.threads = list(stop_token_ids), threads
        self.metrics, self.backend = metrics, backend
        self.tokenizer = None
        self.compiler = None              # xgrammar's
        self.guidance = None              # llguidance's tokenizer
        self._seen: set[tuple[str, str]] = set()
        self._enforced: set[str] = set()  # schemas xgrammar was seen to enforce (not as any JSON)
        self._lock = threading.Lock()

    def _load(self, backend: str) -> None:
        with self._lock:
            if self.tokenizer is None:
                self.tokenizer = self.load_tokenizer()
            if backend == "xgrammar" and self.compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer,
                                                          vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._xgr = xgr
                self.compiler = xgr.GrammarCompiler(info, max_threads=self.threads)
            elif backend == "guidance" and self.guidance is None:
                import llguidance.hf

                self.guidance = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.stop_token_ids)

    def compile(self, spec: StructuredSpec) -> Compiled:
        """-> the spec compiled by the first backend that can; raises `RequestError` on
        `spec.field` when none can (an unsupported schema feature, a bad regex), with each
        backend's reason."""
        if spec.kind not in KINDS:
            raise RequestError(spec.field, spec.kind, f"must be one of {', '.join(KINDS)}")
        start = time.perf_counter()
        reasons = []
        for backend in (("xgrammar", "guidance") if self.backend == "auto"
                        else (self.backend,)):
            self._load(backend)
            try:
                grammar = (self._xgrammar if backend == "xgrammar" else self._llguidance)(spec)
            except Exception as exc:  # noqa: BLE001 — the backends raise RuntimeError / ValueError
                reasons.append(f"{backend}: {_reason(exc)}" if self.backend == "auto"
                               else _reason(exc))
                continue
            with self._lock:
                cached = (spec.kind, spec.value) in self._seen
                self._seen.add((spec.kind, spec.value))
            if self.metrics is not None:
                self.metrics.compiled(spec.kind, time.perf_counter() - start, cached)
            return Compiled(backend, grammar)
        raise RequestError(spec.field, _short(spec.value),
                           f"cannot be compiled to a grammar: {'; '.join(reasons)}")

    def _xgrammar(self, spec: StructuredSpec):
        if spec.kind == "json_schema":
            compiled = self.compiler.compile_json_schema(spec.value, any_whitespace=False)
            if spec.value not in self._enforced and _rejects_null(spec.value) and \
                    self._xgr.GrammarMatcher(compiled).accept_string("null"):
                # xgrammar gave up on a keyword (allOf of if/then, say) with a warning only
                # and reads the schema as any JSON value: served, its constraints would go
                # unenforced
                raise ValueError("xgrammar reads this schema as any JSON value (a keyword "
                                 "it cannot express, such as allOf with if/then): its "
                                 "constraints would not be enforced")
            self._enforced.add(spec.value)   # checked once per schema, as compiles are cached
            return compiled
        if spec.kind == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        if spec.kind == "regex":
            return self.compiler.compile_regex(spec.value)
        if spec.kind == "tagged_json":
            return self.compiler.compile_grammar(tagged_json(self._xgr, spec.value))
        return self.compiler.compile_grammar(spec.value)

    def _llguidance(self, spec: StructuredSpec) -> str:
        import llguidance as llg

        compact = {"whitespace_flexible": False}
        if spec.kind == "json_schema":
            grammar = llg.LLMatcher.grammar_from_json_schema(spec.value, defaults=compact)
        elif spec.kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                             defaults=compact)
        elif spec.kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(spec.value)
        elif spec.kind == "tagged_json":
            grammar = llg.LLMatcher.grammar_from_lark(tagged_lark(spec.value))
        else:                              # EBNF: GBNF (xgrammar's form) or Lark
            grammar = llg.grammar_from("grammar", spec.value)
        error = llg.LLMatcher.validate_grammar(grammar, self.guidance)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled: Compiled, after: str | None = None) -> Matcher:
        self._load(compiled.backend)
        if compiled.backend == "xgrammar":
            return Matcher(self._xgr.GrammarMatcher(compiled.grammar), self, after)
        import llguidance

        return Matcher(GuidanceState(llguidance.LLMatcher(self.guidance, compiled.grammar)),
                       self, after)

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


class GuidanceState:
    """An llguidance matcher with xgrammar's matcher methods, as `Matcher` calls them."""

    def __init__(self, matcher):
        self.matcher = matcher

    def accept_token(self, token: int) -> bool:
        return self.matcher.consume_token(token)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()


def masks(matchers: list[Matcher | None], metrics=None) -> list[torch.Tensor | None]:
    """Each row's allowed tokens as a packed int32 bitmask [ceil(V/32)], None for an
    unconstrained row."""
    rows = [i for i, m in enumerate(matchers) if m is not None and m.active]
    if not rows:
        return [None] * len(matchers)
    start = time.perf_counter()
    first = matchers[rows[0]].grammars
    bitmask = torch.full((len(rows), -(-first.vocab_size // 32)), -1, dtype=torch.int32)
    for j, i in enumerate(rows):
        matchers[i].state.fill_next_token_bitmask(bitmask, j)
    out: list[torch.Tensor | None] = [None] * len(matchers)
    for j, i in enumerate(rows):
        out[i] = bitmask[j]
    if metrics is not None:
        metrics.masked(time.perf_counter() - start)
    return out


def _rejects_null(schema_text: str) -> bool:
    """The schema's `type` leaves out null (so a grammar that takes `null` is looser)."""
    schema = json.loads(schema_text)
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind is not None and "null" not in ([kind] if isinstance(kind, str) else kind)


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


def tagged_lark(value: str) -> str:
    """`tagged_json`'s grammar in llguidance's Lark: 1..`max_items` objects, each matching
    one of `schemas`, between `prefix` and `suffix`, joined by `separator`."""
    d = json.loads(value)
    schema = json.dumps({"anyOf": d["schemas"], "x-guidance": {"whitespace_flexible": False}})
    item = " ".join(part for part in (d["prefix"] and json.dumps(d["prefix"]), "body",
                                      d["suffix"] and json.dumps(d["suffix"])) if part)
    more = (f" ({json.dumps(d['separator'])} item)" if d["separator"] else " item")
    repeat = f"{more}{{0,{d['max_items'] - 1}}}" if d["max_items"] > 1 else ""
    return (f"start: item{repeat}\nitem: {item}\nbody: %json {schema}\n")


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
