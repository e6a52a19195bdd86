"""Reasoning parsers: a thinking model's `<think>…</think>` goes to `reasoning_content`, the
rest to `content`, whole or streamed (vLLM's `--reasoning-parser`).

`qwen3`: an answer that begins with `<think>` thinks until `</think>`; one without it (the
template's `enable_thinking: false` closes the block in the prompt) is all content.
`deepseek_r1`: the template opens the block in the prompt, so an answer is reasoning until
`</think>`. A grammar (`response_format`, a forced tool call) applies only after the end
tag: `StructuredSpec.after`.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.gateway.stops import tag_start

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    opens_in_prompt: bool          # the answer starts inside the block

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole answer."""
        body = text.lstrip()
        opened = body.startswith(START)
        if opened:
            body = body[len(START):]
        if not (opened or self.opens_in_prompt):
            return None, text
        if END not in body:
            return (body, "") if self.opens_in_prompt or opened else (None, text)
        reasoning, content = body.split(END, 1)
        return reasoning, content.lstrip("\n")


PARSERS = {f.name: f for f in (ReasoningFormat("qwen3", False),
                               ReasoningFormat("deepseek_r1", True))}


class ReasoningStream:
    """A streamed answer: `feed` each text delta, `finish` at the end; each returns
    (reasoning text, content text) to send now. Text that may be the start of a tag is
    held back until it cannot be."""

    def __init__(self, fmt: ReasoningFormat):
        self.fmt = fmt
        self.state = "start"           # start -> thinking -> content
        self.buffer = ""
        self.strip_newlines = False

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning = content = ""
        if self.state == "start":
            lead = self.buffer.lstrip()
            if lead.startswith(START):
                self.buffer = lead[len(START):]
                self.state = "thinking"
            elif START.startswith(lead):
                return "", ""                          # may still become <think>
            else:
                self.state = "thinking" if self.fmt.opens_in_prompt else "content"
        if self.state == "thinking":
            at = self.buffer.find(END)
            if at < 0:
                keep = tag_start(self.buffer, END)
                reasoning = self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning, self.buffer = self.buffer[:at], self.buffer[at + len(END):]
            self.state, self.strip_newlines = "content", True
        if self.state == "content":
            if self.strip_newlines:
                self.buffer = self.buffer.lstrip("\n")
                self.strip_newlines = not self.buffer
            content, self.buffer = self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.state == "thinking":
            return rest, ""
        return "", rest

