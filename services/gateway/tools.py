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

Streaming holds a call back until it is complete, then sends its id and name, then its
arguments in fragments: the fragments concatenate to the same `arguments` string as the
whole response has, since both come from one parse.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from services.common.messages import StructuredSpec
from services.gateway.stops import tag_start

MAX_PARALLEL = 4            # most calls one constrained answer may hold
ARGUMENT_FRAGMENT = 16      # characters per streamed argument fragment


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

    def _call(self, body: str, names: set[str]) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        args = obj.get(self.args_key, obj.get("arguments", obj.get("parameters", {})))
        return ToolCall("call_" + uuid.uuid4().hex[:24], obj["name"],
                        json.dumps(args, ensure_ascii=False))


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
class ToolStream:
    """One streamed answer: `feed` the text deltas, `finish` at the end; each returns
    (content text to send now, tool-call chunks to send now)."""
    format: ToolFormat
    names: set[str]
    buffer: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    whole: bool = False          # llama3_json answer that began with "{": held to the end
    started: bool = False        # any non-space text seen

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        if not self.format.prefix:
            if not self.started and self.buffer.strip():
                self.started = True
                self.whole = self.buffer.lstrip().startswith("{")
            if self.whole or not self.started:
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
            close = self.buffer.find(end, at + len(tag))
            if close < 0:                    # inside a call: wait for its end
                out.append(self.buffer[:at])
                self.buffer = self.buffer[at:]
                break
            block = self.buffer[at:close + len(end)]
            content, calls = self.format.parse(block, self.names)
            out.append(self.buffer[:at] + (content if not calls else ""))
            chunks += self._chunks(calls)
            self.buffer = self.buffer[close + len(end):]
        return "".join(out), chunks

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.buffer = self.buffer, ""
        if self.format.prefix or not self.whole:
            return rest, []          # an unfinished call is text
        content, calls = self.format.parse(rest, self.names)
        return content, self._chunks(calls)

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
