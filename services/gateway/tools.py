"""Tool calling: the formats a model writes its calls in, the grammar that forces a call,
and the parsers that turn generated text back into OpenAI `tool_calls`, whole or streamed.

A format says how calls are written around a JSON object:

- `hermes` (Hermes, Qwen2.5/3, SmolLM2 with the shipped template):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call;
- `llama3_json` (Llama 3.1+ JSON tool calling): the whole answer is
  `{"name": ..., "parameters": {...}}`, calls separated by `; `.

With `tool_choice` `required` or a named function, the output is constrained to calls
(`grammar`): each call's object must name one of the allowed functions and its arguments
must match that function's `parameters` schema; `parallel_tool_calls` allows up to
`MAX_PARALLEL` calls. With `auto` the model writes what it likes, and the text is parsed.

Streaming sends a call as the model writes it, as vLLM's parsers do: its id and name once
the name is complete (and names an offered function), then its arguments' text as it comes.
A call's `arguments` is the text the model wrote for them (compact under a grammar), in the
stream and in the whole response alike, so the fragments concatenate to the whole one's.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from services.common.messages import StructuredSpec
from services.gateway.stops import tag_start

MAX_PARALLEL = 4            # most calls one constrained answer may hold
ARGUMENT_FRAGMENT = 16      # characters per argument fragment of a call sent whole
WHITESPACE = " \t\n\r"


def _string_end(s: str, i: int) -> int | None:
    """Past the JSON string that opens at s[i] (a quote), or None when it has not ended."""
    i += 1
    while i < len(s):
        if s[i] == "\\":
            i += 2
        elif s[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _value_end(s: str, i: int) -> int | None:
    """Past the JSON value that begins at s[i], or None when it has not ended (a number or
    literal ends only at the delimiter after it)."""
    if s[i] == '"':
        return _string_end(s, i)
    if s[i] in "{[":
        depth = 0
        while i < len(s):
            if s[i] == '"':
                end = _string_end(s, i)
                if end is None:
                    return None
                i = end
                continue
            depth += (s[i] in "{[") - (s[i] in "}]")
            i += 1
            if depth == 0:
                return i
        return None
    while i < len(s) and s[i] not in ",}]" + WHITESPACE:
        i += 1
    return i if i < len(s) else None


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in WHITESPACE:
        i += 1
    return i


@dataclass
class PartialCall:
    """A call's JSON object as far as it has come: its `name` once that string is complete,
    the raw text of its arguments value so far (`args`, None before it begins), whether that
    value is complete, and the index past the object's closing brace once there is one."""
    name: str | None = None
    args: str | None = None
    args_done: bool = False
    end: int | None = None


def scan_call(body: str, args_keys: tuple[str, ...]) -> PartialCall | None:
    """The object `body` begins with (after whitespace), read as far as it has come; None
    when it is not an object of string keys. The arguments are the first key of
    `args_keys` present."""
    out, i = PartialCall(), _skip(body, 0)
    if i == len(body):
        return out
    if body[i] != "{":
        return None
    i += 1
    while True:
        i = _skip(body, i)
        if i == len(body):
            return out
        if body[i] == "}":
            out.end = i + 1
            return out
        if body[i] == ",":
            i += 1
            continue
        if body[i] != '"':
            return None
        key_end = _string_end(body, i)
        if key_end is None:
            return out
        key = json.loads(body[i:key_end])
        i = _skip(body, key_end)
        if i == len(body):
            return out
        if body[i] != ":":
            return None
        i = _skip(body, i + 1)
        if i == len(body):
            return out
        end = _value_end(body, i)
        if key in args_keys and out.args is None:
            out.args, out.args_done = body[i:len(body) if end is None else end], end is not None
        elif key == "name" and end is not None and body[i] == '"':
            out.name = json.loads(body[i:end])
        if end is None:
            return out
        i = end


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str          # JSON text

    def wire(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ToolFormat:
    name: str
    prefix: str             # before each call's JSON object
    suffix: str             # after it
    separator: str          # between calls
    args_key: str           # the object's key for the arguments

    def grammar(self, functions: list[dict], parallel: bool) -> StructuredSpec:
        """Output that is only calls of `functions` ({name, parameters}), one or (parallel)
        up to MAX_PARALLEL."""
        schemas = [{"type": "object", "additionalProperties": False,
                    "required": ["name", self.args_key],
                    "properties": {"name": {"const": f["name"]},
                                   self.args_key: f.get("parameters") or {"type": "object"}}}
                   for f in functions]
        value = {"prefix": self.prefix, "suffix": self.suffix, "separator": self.separator,
                 "schemas": schemas, "max_items": MAX_PARALLEL if parallel else 1}
        return StructuredSpec("tagged_json", json.dumps(value), "tools")

    def parse(self, text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
        """(the text outside the calls, the calls) of a whole answer; a block that is not
        a call of a known function stays text."""
        if self.prefix:
            calls, kept, pos = [], [], 0
            pattern = re.compile(re.escape(self.prefix.strip()) + r"\s*(.*?)\s*"
                                 + re.escape(self.suffix.strip()), re.S)
            for m in pattern.finditer(text):
                call = self._call(m.group(1), names)
                if call is None:
                    continue
                kept.append(text[pos:m.start()])
                pos = m.end()
                calls.append(call)
            kept.append(text[pos:])
            return ("".join(kept).strip() if calls else text), calls
        stripped = text.strip()
        if not stripped.startswith("{"):
            return text, []
        calls = [self._call(part, names) for part in stripped.split(self.separator.strip())]
        if not calls or None in calls:
            return text, []
        return "", calls

    @property
    def args_keys(self) -> tuple[str, ...]:
        return (self.args_key, "arguments", "parameters")

    def _call(self, body: str, names: set[str], call_id: str | None = None) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        found = scan_call(body, self.args_keys)
        # the arguments as the model wrote them (what a stream sends), else none given
        args = found.args if found is not None and found.args_done else "{}"
        return ToolCall(call_id or new_call_id(), obj["name"], args)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


FORMATS = {f.name: f for f in (
    ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "arguments"),
    ToolFormat("llama3_json", "", "", "; ", "parameters"),
)}


def default_format(chat_template: str | None) -> str:
    """The parser a model's chat template implies: Llama 3's JSON calls when its template
    speaks of `ipython`/`<|python_tag|>`, else Hermes blocks."""
    if chat_template and ("<|python_tag|>" in chat_template or "ipython" in chat_template):
        return "llama3_json"
    return "hermes"


@dataclass
class OpenCall:
    """A call being streamed: its place among the answer's calls, id, name, and how much of
    its arguments' text has been sent."""
    index: int
    id: str
    name: str
    sent: str = ""


@dataclass
class ToolStream:
    """One streamed answer: `feed` the text deltas, `finish` at the end; each returns
    (content text to send now, tool-call chunks to send now). A call is sent as it is
    written: its id and name once its name is complete and offered, then each new piece of
    its arguments' text. Text that is not a call is content; a call the answer leaves
    unfinished (cut by max_tokens) ends where it was cut."""
    format: ToolFormat
    names: set[str]
    buffer: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    whole: bool = False          # llama3_json answer that began with "{": calls, or text
    started: bool = False        # any non-space text seen
    open: OpenCall | None = None
    at: int = 0                  # whole answers: where in `buffer` the next call begins

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        if not self.format.prefix:
            if not self.started and self.buffer.strip():
                self.started = True
                self.whole = self.buffer.lstrip().startswith("{")
            if self.whole:
                return "", self._stream_whole()
            if not self.started:
                return "", []
            out, self.buffer = self.buffer, ""
            return out, []
        out, chunks = [], []
        tag, end = self.format.prefix.strip(), self.format.suffix.strip()
        while self.buffer:
            at = self.buffer.find(tag)
            if at < 0:                       # no call begins: hold back a partial tag
                keep = tag_start(self.buffer, tag)
                out.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            out.append(self.buffer[:at])
            self.buffer = self.buffer[at:]
            close = self.buffer.find(end, len(tag))
            body = self.buffer[len(tag):close if close >= 0 else len(self.buffer)]
            chunks += self._advance(body)
            if close < 0:                    # inside a call: wait for more of it
                break
            if self.open is not None:
                chunks += self._close(body)
            else:                            # not a call of an offered function: text
                out.append(self.buffer[:close + len(end)])
            self.buffer = self.buffer[close + len(end):]
        return "".join(out), chunks

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.buffer = self.buffer, ""
        if self.open is not None:            # cut inside a call already sent: it ends here
            self.open = None
            return "", []
        if not self.whole:
            return rest, []                  # an unfinished call is text
        if self.calls:
            return "", []
        content, calls = self.format.parse(rest, self.names)
        return content, self._chunks(calls)

    def _stream_whole(self) -> list[dict]:
        """A whole answer of calls (`{...}; {...}`): each object streamed as it comes."""
        chunks, sep = [], self.format.separator.strip()
        while True:
            nxt = _skip(self.buffer, self.at)
            if self.at and self.buffer.startswith(sep, nxt):    # after a call: the next
                self.at = nxt + len(sep)
            body = self.buffer[self.at:]
            chunks += self._advance(body)
            found = scan_call(body, self.format.args_keys)
            if found is None or found.end is None:
                return chunks
            if self.open is not None:
                chunks += self._close(body[:found.end])
            self.at += found.end

    def _advance(self, body: str) -> list[dict]:
        """What is new of the call `body` holds so far: its header once it names an offered
        function, then its arguments' new text."""
        found = scan_call(body, self.format.args_keys)
        if found is None:
            return []
        chunks = []
        if self.open is None:
            if found.name is None or found.name not in self.names:
                return []
            self.open = OpenCall(len(self.calls), new_call_id(), found.name)
            chunks.append({"index": self.open.index, "id": self.open.id, "type": "function",
                           "function": {"name": found.name, "arguments": ""}})
        if found.args is not None and len(found.args) > len(self.open.sent):
            chunks.append({"index": self.open.index,
                           "function": {"arguments": found.args[len(self.open.sent):]}})
            self.open.sent = found.args
        return chunks

    def _close(self, body: str) -> list[dict]:
        """The streamed call's block is complete: the rest of its arguments (none given:
        `{}`, as a whole answer has)."""
        call = self.format._call(body, self.names, self.open.id)
        sent = self.open.sent
        args = (call.arguments if call is not None and call.arguments.startswith(sent)
                else sent)                   # what was sent stands
        chunks = ([{"index": self.open.index, "function": {"arguments": args[len(sent):]}}]
                  if len(args) > len(sent) else [])
        self.calls.append(ToolCall(self.open.id, self.open.name, args))
        self.open = None
        return chunks

    def _chunks(self, calls: list[ToolCall]) -> list[dict]:
        chunks = []
        for call in calls:
            index = len(self.calls)
            self.calls.append(call)
            chunks.append({"index": index, "id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            chunks += [{"index": index, "function": {"arguments": piece}}
                       for piece in fragments(call.arguments)]
        return chunks


def fragments(arguments: str) -> list[str]:
    """A call's arguments as the pieces a stream sends (they concatenate to it)."""
    return [arguments[a:a + ARGUMENT_FRAGMENT]
            for a in range(0, len(arguments), ARGUMENT_FRAGMENT)]
