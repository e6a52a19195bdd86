"""OpenAI-compatible request bodies and the OpenAI-style error body."""
from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from kernels.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY
from services.common.messages import StructuredSpec

MAX_CHOICES = 16          # most candidates one request may generate (`n`, `best_of`)
MAX_PROMPTS = 128         # most prompts in one completions request (a batch)


class APIError(Exception):
    """Turned into an OpenAI-style error body with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type_, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# pydantic names a union's members in an error's path ('str', 'list[int]',
# 'function-after[...]'): not fields, so not part of the path a client is told
_UNION_MEMBERS = {"str", "int", "float", "bool", "dict", "list"}


def validation_error(errors: list[dict]) -> APIError:
    """The 400 for a body pydantic refused (FastAPI's errors, paths under "body"): `param`
    is the top-level field of the first error, as OpenAI names it; the message lists each
    error with its path. A value that has one of a union's types but is refused by it
    (a prompt string with a lone surrogate) is reported alone, without the type errors of
    the members it did not match."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return APIError(400, "request body is not valid JSON")
    found = []                     # (path, message, a type error), in the errors' order
    for e in errors:
        path = [str(p) for p in e.get("loc", ())[1:]
                if not (isinstance(p, str) and ("[" in p or p in _UNION_MEMBERS))]
        msg = e.get("msg", "invalid").removeprefix("Value error, ")
        found.append((path, msg, e.get("type", "").endswith("_type")))
    for field in {p[0] for p, _, _ in found if p}:
        mine = [f for f in found if f[0][:1] == [field]]
        if not all(wrong_type for _, _, wrong_type in mine):
            found = [f for f in found if f not in mine or not f[2]]
    lines = list(dict.fromkeys(f"{'.'.join(p) or 'request body'}: {msg}"
                               for p, msg, _ in found))
    param = found[0][0][0] if found and found[0][0] else None
    return APIError(400, "; ".join(lines) or "invalid request body", param)


# Request bodies are validated strictly: JSON's own types only, so `"max_tokens": true`,
# `"stream": "yes"` or `"temperature": "0.5"` are a 400 rather than coerced to 1, True or 0.5
# (an integer is still a valid float). Python's JSON parser reads NaN and Infinity: they are
# refused as not finite, before any range check could misreport them.
STRICT = ConfigDict(strict=True, allow_inf_nan=False)


def _encodable(text: str) -> str:
    """JSON's `\\ud800` escapes can spell a lone UTF-16 surrogate, which is no Unicode
    character: the tokenizer cannot take it, nor can a response carry it back."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"holds a lone surrogate (U+{ord(text[exc.start]):04X}) at "
                         f"character {exc.start}: text must be valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]   # text the tokenizer or client reads


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


# OpenAI (and vLLM) request fields not implemented here, each with the values that ask for
# nothing (null is always accepted)
UNSUPPORTED: dict[str, tuple] = {
    "top_logprobs": (0,), "best_of": (1,),     # chat: best_of; completions: top_logprobs
    "echo": (False,), "suffix": ("",), "tools": ([],), "functions": ([],),
    "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
}

# fields of the other endpoint
HINTS = {"top_logprobs": "a chat completions field; completions ask with `logprobs: k`",
         "best_of": "a completions field; chat completions take `n`",
         "echo": "a completions field"}

_Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]


class JSONSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


MAX_GRAMMAR_CHARS = 1 << 16      # a schema, regex or grammar longer than this is refused


def _bounded(spec: StructuredSpec) -> StructuredSpec:
    if len(spec.value) > MAX_GRAMMAR_CHARS:
        raise APIError(400, f"{spec.field} is {len(spec.value)} characters; at most "
                            f"{MAX_GRAMMAR_CHARS} are accepted", spec.field)
    return spec


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of these."""
    model_config = ConfigDict(extra="forbid")

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[Text] | None = None
    grammar: str | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # None: model default
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)   # torch's seed range
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    # null: none (0, 0 and 1)
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float | None = Field(default=None, gt=0.0)   # vLLM's extension
    # token id (a string, as JSON keys are) -> value added to its logit
    logit_bias: dict[str, _Bias] | None = None
    ignore_eos: bool = False
    # vLLM's extensions: no end-of-sequence, stop token or stop string before `min_tokens`;
    # token ids that end the answer; the matched stop string kept in the text; special
    # tokens left out of the text
    min_tokens: int | None = Field(default=None, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # prefill extensions: "exact" | "ridgefill", and RidgeFill overrides
    # ({split, tail, fill, selector, budget, value_rescale, key_rescale, terminal_correction,
    #   seed, sink_rows, lexical, lexical_rank})
    prefill_mode: str | None = None
    ridgefill: dict | None = None
    # Tail-Replay: share of a prefix-cache hit replayed into the linear-attention states
    # (None: the server's --replay-ratio; 0: zero-only)
    replay_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    # structured outputs: OpenAI's response_format, or vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def check_supported(self) -> None:
        """Refuse OpenAI fields this server does not implement when they ask for something
        (a client that sends their defaults, e.g. `echo: false`, is served): an ignored
        `echo` or `tools` would return an answer to another request."""
        fields = self.model_extra or {}
        for name, default in UNSUPPORTED.items():
            value = fields.get(name)
            if value is not None and value not in default:
                hint = HINTS.get(name, "not supported by this server")
                raise APIError(400, f"{name} is {hint} (got {value!r})", name)

    def structured_spec(self) -> StructuredSpec | None:
        """The grammar the output must match, from `response_format` or
        `structured_outputs` (not both); None: free text."""
        fmt, so = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text":
            if so is not None:
                raise APIError(400, "set response_format or structured_outputs, not both",
                               "structured_outputs")
            if fmt.type == "json_object":
                return StructuredSpec("json_object", "", "response_format")
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(400, "response_format of type json_schema needs "
                                    "json_schema.schema", "response_format")
            return _bounded(StructuredSpec("json_schema", json.dumps(fmt.json_schema.schema_),
                                           "response_format"))
        if so is None:
            return None
        given = [k for k in ("json_", "regex", "choice", "grammar")
                 if getattr(so, k) is not None]
        if len(given) != 1:
            raise APIError(400, "structured_outputs takes exactly one of json, regex, choice "
                                f"and grammar (got {len(given)})", "structured_outputs")
        field = "structured_outputs." + given[0].rstrip("_")
        if so.json_ is not None:
            schema = so.json_
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise APIError(400, f"{field} is not JSON: {exc}", field) from None
            if not isinstance(schema, dict):
                raise APIError(400, f"{field} must be a JSON schema object", field)
            return _bounded(StructuredSpec("json_schema", json.dumps(schema), field))
        if so.choice is not None:
            if not so.choice or any(c == "" for c in so.choice):
                raise APIError(400, f"{field} must be a list of non-empty strings", field)
            return _bounded(StructuredSpec("grammar", "root ::= " + " | ".join(
                json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(so.choice)), field))
        if so.regex is not None:
            return _bounded(StructuredSpec("regex", so.regex, field))
        return _bounded(StructuredSpec("grammar", so.grammar, field))

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            digits = key.strip()
            # ASCII digits only: str.isdigit() also takes '²' or '٣', which int() refuses;
            # past 20 digits no id fits a vocabulary (nor int()'s digit limit)
            if not (digits.isascii() and digits.isdigit() and len(digits) <= 20):
                raise APIError(400, f"logit_bias keys must be token ids (ASCII digits), got "
                                    f"{key[:40]!r}", "logit_bias")
            pairs.append((int(digits), value))
        return tuple(sorted(pairs))

    def max_new_tokens(self) -> tuple[int | None, str]:
        """The most tokens to generate, and the field that asked for it."""
        return self.max_tokens, "max_tokens"

    def prompt_field(self) -> str:
        """The field that holds the prompt."""
        return "prompt"

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def logprobs_k(self) -> int | None:
        """How many alternatives each generated token reports (None: no log-probs)."""
        raise NotImplementedError

    def candidates(self) -> int:
        """How many completions to generate: `n`, or completions' `best_of`."""
        return self.n

    def prompt_logprobs_k(self) -> int | None:
        """Alternatives per prompt token (completions' `echo` with `logprobs`)."""
        return None


class CompletionRequest(_Common):
    # one prompt (text or token ids) or a batch of them; each gets its own n choices
    prompt: Text | list[int] | list[Text] | list[list[int]]
    # the sampled token's log-prob and this many alternatives (OpenAI's legacy integer;
    # false and null ask for none)
    logprobs: bool | int | None = None
    # generate this many and return the n with the highest log-probability (not streamed)
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    echo: bool = False             # the prompt before the completion (and its log-probs)

    def prompt_logprobs_k(self) -> int | None:
        return self.logprobs_k() if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The batch: each prompt as text or token ids."""
        p = self.prompt
        batch = [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)
        if len(batch) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(batch)}",
                           "prompt")
        return batch

    def candidates(self) -> int:
        if self.best_of is None:
            return self.n
        if self.best_of < self.n:
            raise APIError(400, f"best_of ({self.best_of}) must be at least n ({self.n})",
                           "best_of")
        if self.stream and self.best_of > self.n:
            raise APIError(400, "best_of > n cannot be streamed", "best_of")
        return self.best_of

    def logprobs_k(self) -> int | None:
        k = self.logprobs
        if k is None or k is False:
            return None
        if k is True or not 0 <= k <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be an integer in [0, {MAX_LOGPROBS}] "
                                f"(got {k!r})", "logprobs")
        return k


class ContentPart(BaseModel):
    """A chat content part. Only text parts are served (text-only models): an image or
    audio part is refused, and so is a text part without its text."""
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: Text | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"content part of type {self.type[:40]!r} is not supported: "
                             f"this server takes text parts only")
        if self.text is None:
            raise ValueError("a text content part needs `text`, a string")
        return self


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str              # JSON text, as the model wrote it


class ToolCallIn(BaseModel):
    """An assistant message's earlier call, sent back in the history."""
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None      # assistant: the calls it made
    tool_call_id: str | None = None                 # tool: the call this answers

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs `tool_call_id`, the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry `tool_calls`")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def rendered(self) -> dict:
        """The message as chat templates read it (tool calls and ids kept)."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None      # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


# chat_template_kwargs may not set what the server passes itself
RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "tokenize",
                            "chat_template", "continue_final_message"}


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
    model_config = STRICT

    model: str
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True          # messages: end with the assistant's turn
    add_special_tokens: bool = False            # prompt: the tokenizer's BOS / EOS

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "send either prompt or messages", "prompt")


class DetokenizeRequest(BaseModel):
    model_config = STRICT

    model: str
    tokens: list[int]


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None      # vLLM's: e.g. {"enable_thinking": false}

    def tool_mode(self) -> str | None:
        """None (no tools offered, or `none`), "auto", "required", or the one function's
        name the answer must call; refuses a choice that names no offered function."""
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise APIError(400, "tools: function names must be unique", "tools")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise APIError(400, f"tool_choice names {choice.function.name!r}, which is "
                                    f"not among the tools ({', '.join(names) or 'none'})",
                               "tool_choice")
            return choice.function.name
        if choice == "required" and not names:
            raise APIError(400, "tool_choice 'required' needs tools", "tool_choice")
        if not names or choice == "none":
            return None
        return choice or "auto"

    def template_kwargs(self) -> dict:
        kwargs = self.chat_template_kwargs or {}
        bad = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if bad:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(bad)}",
                           "chat_template_kwargs")
        return kwargs

    def max_new_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def prompt_field(self) -> str:
        return "messages"

    def logprobs_k(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return self.top_logprobs or 0
